"""P6: the full tiny pipeline: seconds of audio per second of wall time, and the split by stage.

For 10 s and 60 s of audio, one_shot-free (everything loaded), one thread, in process.
``--smoke``: 0.5 s of audio, no warm-up run.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from bench.common import args, report


def main() -> None:
    from songserve.pipeline.checkpoints.layout import resolve
    from songserve.pipeline.checkpoints.megatron_env import init_megatron
    from songserve.pipeline.context import TaskContext
    from songserve.pipeline.pipeline import ModelPipeline
    from songserve.pipeline.types import TrackRequest
    from songserve.worker.settings import WorkerSettings

    a = args(__doc__)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        s = WorkerSettings(output_dir=Path(tmp), runtime_mode="keep_loaded")
        init_megatron(torch.device("cpu"), 0, seed=0)
        pipe = ModelPipeline(s, resolve(s), torch.device("cpu"))
        pipe.load()
        parts = []
        for seconds in [0.5] if a.smoke else [10, 60]:
            req = TrackRequest(lyrics="hello\nworld", tags="pop", duration=seconds / 60, seed=1, task_id="bench")
            if seconds == 10:  # warm-up before the first size (the smoke's numbers are not read)
                pipe.run(req, TaskContext("warm"))
            r = pipe.run(req, TaskContext("bench"))
            t = r.metadata["timings"]
            stages = {k: t[f"{k}_sec"] for k in ("backbone", "superres", "decoder", "export")}
            wall = sum(stages.values())
            split = ", ".join(f"{k} {v:.2f}s ({100 * v / wall:.0f}%)" for k, v in stages.items())
            parts.append(f"{seconds:g}s audio: {r.duration_sec / wall:.1f}x real time [{split}]")
    report("P6", "tiny pipeline, 1 thread: " + "; ".join(parts))


if __name__ == "__main__":
    main()
