"""P9: N takes of one prompt as one batch vs one take alone (backbone, and the whole tiny track).

Baseline in the same run: the same seed alone. Backbone: tiny (2×64) and mid (8×512) random-weight
models, one thread, N = 2 and 4, exact-length songs (no end-of-audio), so every row runs the
whole budget. Whole track: the tiny set through ``ModelPipeline.run_batch`` vs ``run``.
Targets on the CPU: backbone ≤ 1.25× (tiny, 2 takes) and ≤ 1.6× (mid, 2 takes).

Times are the process's CPU time (one thread: the work done), the best of ``--repeats`` rounds
that run 1, 2 and 4 takes in turn: on a VM shared with other sessions wall time also counts
the time the process waited for a core, which moved single runs by ±20 %.

``--smoke``: the tiny backbone only, 8 frames, a 0.5 s track, 2 takes, one round, no warm-up.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.common import args, report


def _ratios(run: Callable[[int], float], ns: list[int], repeats: int, warm: bool = True) -> dict[int, float]:
    """Best time of each batch size over ``repeats`` interleaved rounds, as a ratio to one take."""
    if warm:
        run(1)
    best: dict[int, float] = {}
    for _ in range(repeats):
        for n in [1, *ns]:
            best[n] = min(best.get(n, math.inf), run(n))
    return {n: best[n] / best[1] for n in ns}


def backbone_ratio(
    layers: int, hidden: int, heads: int, frames: int, ns: list[int], repeats: int, warm: bool = True
) -> dict[int, float]:
    from songserve.pipeline.context import TaskContext
    from songserve.pipeline.engine.arch import GPTArch
    from songserve.pipeline.engine.gpt import AcousticGPT, build_model
    from songserve.pipeline.numbers import BACKBONE_LEVELS, CODEBOOK
    from songserve.pipeline.stages.backbone import Backbone, Take
    from songserve.pipeline.stages.length import LengthPlan

    vocab = 1024 + BACKBONE_LEVELS * CODEBOOK
    arch = GPTArch("backbone", layers, hidden, heads, 4 * hidden, 1024, vocab, 2 * frames + 64, 64)
    bb = Backbone(AcousticGPT(arch, build_model(arch, torch.device("cpu"), torch.float32)), eod_id=1)
    prompt = list(range(2, 34))

    def run(n: int) -> float:
        takes = [Take(torch.Generator().manual_seed(i), TaskContext(f"t{i}")) for i in range(n)]
        t0 = time.process_time()
        bb.generate_batch(prompt, LengthPlan(frames, frames, 2 * frames), takes, top_k=50, temperature=1.0)
        return time.process_time() - t0

    return _ratios(run, ns, repeats, warm)


def track_ratio(seconds: float, ns: list[int], repeats: int, warm: bool = True) -> dict[int, float]:
    import dataclasses

    from songserve.pipeline.checkpoints.layout import resolve
    from songserve.pipeline.context import TaskContext
    from songserve.pipeline.pipeline import ModelPipeline
    from songserve.pipeline.types import TrackRequest
    from songserve.worker.settings import WorkerSettings

    with tempfile.TemporaryDirectory() as tmp:
        s = WorkerSettings(output_dir=Path(tmp), runtime_mode="keep_loaded")
        pipe = ModelPipeline(s, resolve(s), torch.device("cpu"))
        pipe.load()
        req = TrackRequest(lyrics="hello world", tags="pop", duration=seconds / 60, seed=1)

        def run(n: int) -> float:
            reqs = [dataclasses.replace(req, seed=i, task_id=f"t{i}") for i in range(n)]
            t0 = time.process_time()
            pipe.run_batch(reqs, [TaskContext(r.task_id) for r in reqs])
            return time.process_time() - t0

        return _ratios(run, ns, repeats, warm)


def main() -> None:
    from songserve.pipeline.checkpoints.megatron_env import init_megatron

    a = args(__doc__, frames=600, seconds=10.0, repeats=3)
    torch.set_num_threads(1)
    init_megatron(torch.device("cpu"), 0, seed=0)
    frames = 8 if a.smoke else a.frames
    ns = [2] if a.smoke else [2, 4]
    parts = []
    models = {"tiny 2x64": (2, 64, 4)} if a.smoke else {"tiny 2x64": (2, 64, 4), "mid 8x512": (8, 512, 8)}
    for name, shape in models.items():
        r = backbone_ratio(*shape, frames=frames, ns=ns, repeats=1 if a.smoke else a.repeats, warm=not a.smoke)
        parts.append(f"backbone {name}: " + ", ".join(f"{n} takes {x:.2f}x" for n, x in r.items()))
    r = track_ratio(0.5 if a.smoke else a.seconds, ns, 1 if a.smoke else a.repeats, warm=not a.smoke)
    parts.append("whole tiny track: " + ", ".join(f"{n} takes {x:.2f}x" for n, x in r.items()))
    report(
        "P9", f"N takes in one batch vs one take alone, {2 * frames} tokens, 1 thread, CPU time: " + "; ".join(parts)
    )


if __name__ == "__main__":
    main()
