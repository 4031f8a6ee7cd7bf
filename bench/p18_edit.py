"""P18: the cost of an edit against making the song: a repaint of 20 s in the middle of a 3-minute
take, and a 20 s opening before it, each against generating the 3-minute take itself.

The whole tiny-set pipeline in this process (the worker's own stages: backbone, super-resolution,
decoder, export), one thread, on the CPU: the baseline generates the take (seed 3), then the repaint
(60–80 s, rejoined within ``REPAINT_JOIN_WINDOW_SEC`` = 1 s) and the opening run on its grid, each
``--repeats`` times, best wall time of each (the VM is shared). The backbone writes only the new part
and the join window; super-resolution runs only the windows that hold new frames (``--sr-context``
frames around them, ``REPAINT_CONTEXT_FRAMES``; 0 = the model's whole window); the decoder decodes only
the chunks that hold changed samples, the original's decoded audio being kept in this process as a
worker keeps the takes it made (``EDIT_AUDIO_MB``), and each edit runs once more without it (the whole
song decoded: an edit on a worker that did not make the take); the export still writes the whole song.
Each stage's share of the edit is printed beside the ratio. ``--smoke``: a 6 s take, a 1 s repaint and
opening, one round.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import ROOT, args, report

RATE, HOP = 44_100, 2_048
SONG = {"lyrics": "[verse]\nthe long take\nits middle written again", "tags": "pop, piano"}


def timed(pipe: Any, req: Any) -> tuple[float, Any]:
    from songserve.pipeline.context import TaskContext

    t0 = time.perf_counter()
    (got,) = pipe.run_batch([req], [TaskContext(req.task_id)])
    assert not isinstance(got, BaseException), got
    return time.perf_counter() - t0, got


def main() -> None:
    from songserve.audio import codes as codes_file
    from songserve.pipeline.checkpoints.layout import resolve
    from songserve.pipeline.checkpoints.megatron_env import init_megatron
    from songserve.pipeline.pipeline import ModelPipeline
    from songserve.pipeline.stages.kept_audio import KeptAudio
    from songserve.pipeline.types import Prefix, Repaint, TrackRequest
    from songserve.worker.settings import WorkerSettings

    a = args(__doc__, repeats=2, minutes=3.0, part_sec=20.0, sr_context=24)
    torch.set_num_threads(1)
    init_megatron(torch.device("cpu"), 0, seed=0)
    minutes, part, repeats = (0.1, 1.0, 1) if a.smoke else (a.minutes, a.part_sec, a.repeats)
    s = WorkerSettings(
        output_dir=Path(tempfile.mkdtemp(prefix="p18-")),
        checkpoints_dir=ROOT / "checkpoints" / "tiny",
        runtime_mode="keep_loaded",
        repaint_context_frames=a.sr_context,
    )
    pipe = ModelPipeline(s, resolve(s), torch.device("cpu"))
    pipe.load()
    fps, window = RATE / HOP, round(RATE / HOP)  # a 1 s join window
    base = TrackRequest(**SONG, duration=minutes, seed=3, task_id="p18-song", job_id="p18")  # kept as p18/0
    song_sec, song = min((timed(pipe, base) for _ in range(repeats)), key=lambda x: x[0])
    grid = codes_file.read(s.output_dir / song.codes_filename).codes.astype("<i2")
    frames = grid.shape[1]
    mid = frames // 2
    start, end = mid - round(part * fps / 2), mid + round(part * fps / 2)
    repaint = Prefix(grid.tobytes(), 64, frames, "p18/0", Repaint(start, end, window))
    room = round(part * fps)
    opened = np.concatenate([np.zeros((64, room), dtype="<i2"), grid], axis=1)
    opening = Prefix(opened.tobytes(), 64, opened.shape[1], "p18/0", Repaint(0, room, window, opening=room))
    rows = []
    kept, none = pipe.kept_audio, KeptAudio(0)
    for name, prefix, audio in (
        ("repaint", repaint, kept),
        ("opening", opening, kept),
        ("repaint, whole song decoded", repaint, none),
        ("opening, whole song decoded", opening, none),
    ):
        pipe.kept_audio = audio
        req = TrackRequest(**SONG, duration=minutes, seed=5, task_id=f"p18-{name}", prefix=prefix)
        sec, got = min((timed(pipe, req) for _ in range(repeats)), key=lambda x: x[0])
        t = got.metadata["timings"]
        stages = ", ".join(f"{k.removesuffix('_sec')} {v:.1f}" for k, v in t.items() if k.endswith("_sec") and v)
        decoded, of = got.metadata["repainted"]["decoded_chunks"]
        rows.append(
            f"{name} {part:g} s: {sec / song_sec:.2f}x ({sec:.1f} vs {song_sec:.1f} s; {stages}; "
            f"decoder chunks {decoded}/{of})"
        )
    pipe.kept_audio = kept
    report(
        "P18",
        f"edit vs generating the {frames / fps:.0f} s take, tiny set, 1 thread, wall time, "
        f"super-resolution context {a.sr_context} frames: " + "; ".join(rows),
    )


if __name__ == "__main__":
    main()
