"""P15: a retake's time to its first new frame, with a KV snapshot of its prefix vs without.

A retake prefills the prompt plus every kept token before it samples; a snapshot of the same
prefix (the second retake of one point) leaves one token to prefill. Measured on the backbone
alone, where the difference is: random-weight tiny (2×64) and mid (8×512) models, one thread, a
100-token prompt and 20 s / 60 s of kept audio (860 / 2,584 tokens), generating one new frame.
Baseline in the same run: the same retake with the snapshots cleared. Times are the process's CPU
time, best of ``--repeats`` interleaved rounds (the VM is shared; wall time counts waits for a
core). Also reported: whether the first ``--frames`` new frames are the same codes both ways
(``--seeds`` seeds): a restored prefill agrees with a fresh one to float rounding only.
``--smoke``: the tiny model, 0.5 s kept, one round and one seed of 2 frames, no warm-up.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from bench.common import args, report


def backbone(layers: int, hidden: int, heads: int, context: int) -> Any:
    from songserve.pipeline.engine.arch import GPTArch
    from songserve.pipeline.engine.gpt import AcousticGPT, build_model
    from songserve.pipeline.engine.kv_snapshots import KVSnapshots
    from songserve.pipeline.numbers import BACKBONE_LEVELS, CODEBOOK
    from songserve.pipeline.stages.backbone import Backbone

    arch = GPTArch("backbone", layers, hidden, heads, 4 * hidden, 1024, 1024 + BACKBONE_LEVELS * CODEBOOK, context, 256)
    torch.manual_seed(0)
    bb = Backbone(AcousticGPT(arch, build_model(arch, torch.device("cpu"), torch.float32)), eod_id=1)
    bb.name, bb.snapshots = "bench", KVSnapshots(1 << 32)
    return bb


def first_frames(bb: Any, prompt: list[int], kept: torch.Tensor, frames: int, seed: int) -> tuple[float, torch.Tensor]:
    """CPU seconds to the retake's first ``frames`` new frames, and those frames' codes."""
    from songserve.pipeline.context import TaskContext
    from songserve.pipeline.stages.backbone import Take
    from songserve.pipeline.stages.length import LengthPlan

    n = kept.shape[1] + frames
    take = Take(torch.Generator().manual_seed(seed), TaskContext("p15"))
    t0 = time.process_time()
    got = bb.generate_batch(prompt, LengthPlan(n, n, 2 * n), [take], top_k=50, temperature=1.0, kept=kept)[0]
    sec = time.process_time() - t0
    assert got is not None
    return sec, got.codes[:, kept.shape[1] :]


def measure(shape: tuple[int, int, int], kept_sec: float, repeats: int, seeds: int, frames: int, warm: bool) -> str:
    kept_frames = int(kept_sec * 44100 / 2048)
    bb = backbone(*shape, context=100 + 2 * (kept_frames + frames) + 8)
    prompt = list(range(2, 102))
    kept = torch.randint(0, 1024, (2, kept_frames), generator=torch.Generator().manual_seed(1))
    cold = warm = math.inf
    if warm:
        first_frames(bb, prompt, kept, 1, 0)  # warm-up (and a snapshot)
    for _ in range(repeats):
        bb.snapshots.clear()
        cold = min(cold, first_frames(bb, prompt, kept, 1, 0)[0])  # saves the snapshot the next one restores
        warm = min(warm, first_frames(bb, prompt, kept, 1, 0)[0])
    same = 0
    for s in range(seeds):
        bb.snapshots.clear()
        _, fresh = first_frames(bb, prompt, kept, frames, 100 + s)
        _, restored = first_frames(bb, prompt, kept, frames, 100 + s)
        same += int(torch.equal(fresh, restored))
    tokens = len(prompt) + 2 * kept_frames
    name = f"{shape[0]}x{shape[1]}"
    return (
        f"{name} {kept_sec:g} s kept ({tokens} tokens): {warm / cold:.3f}x ({1000 * warm:.1f} vs "
        f"{1000 * cold:.1f} ms), first {frames} frames equal in {same}/{seeds} seeds"
    )


def main() -> None:
    from songserve.pipeline.checkpoints.megatron_env import init_megatron

    a = args(__doc__, repeats=5, seeds=5, frames=16)
    torch.set_num_threads(1)
    init_megatron(torch.device("cpu"), 0, seed=0)
    if a.smoke:
        cases = [((2, 64, 4), 0.5)]
        repeats, seeds, frames = 1, 1, 2
    else:
        cases = [((2, 64, 4), 20.0), ((2, 64, 4), 60.0), ((8, 512, 8), 20.0), ((8, 512, 8), 60.0)]
        repeats, seeds, frames = a.repeats, a.seeds, a.frames
    parts = [measure(shape, sec, repeats, seeds, frames, not a.smoke) for shape, sec in cases]
    report("P15", "retake's time to first new frame, snapshot vs none, 1 thread, CPU time: " + "; ".join(parts))


if __name__ == "__main__":
    main()
