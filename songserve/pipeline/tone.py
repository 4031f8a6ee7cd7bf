"""The test pipeline: a deterministic tone after a configurable delay, with the real export.

For scheduling and fault tests of the dispatcher (``--pipeline test``): it reports progress through
the same phases, honours cancellation, and writes real WAV/MP3/JSON files. Never a substitute for
the model pipeline in its own tests.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from songserve.pipeline.config import ToneConfig
from songserve.pipeline.context import TaskContext
from songserve.pipeline.numbers import FRAMES_PER_SECOND, HOP, SAMPLE_RATE
from songserve.pipeline.stages.export import Mp3Options, write_track
from songserve.pipeline.types import TrackRequest, TrackResult

PHASES = ("backbone", "superres", "decoding")


class TonePipeline:
    def __init__(self, settings: ToneConfig, max_batch: int = 1) -> None:
        self.s = settings
        self.max_batch = max_batch  # reported in /config, so the dispatcher's packing can be tested against a tone
        self.phase_hook: Callable[[str], None] = lambda phase: None

    def load(self) -> None:
        pass

    def loaded(self) -> dict[str, bool]:
        return {"backbone_loaded": True, "superres_loaded": True, "decoder_loaded": True}

    def describe(self) -> dict[str, Any]:
        return {
            "backbone_models": ["default_backbone"],
            "superres_models": ["default_superres"],
            "sample_rate": SAMPLE_RATE,
            "frame_rate": round(FRAMES_PER_SECOND, 2),
            "test_pipeline": True,
        }

    def limits(self) -> dict[str, Any]:
        return {"max_batch": self.max_batch}

    def run_batch(self, reqs: list[TrackRequest], ctxs: list[TaskContext]) -> list[TrackResult | BaseException]:
        """The takes in turn, each with its own outcome (a cancelled take does not stop the others)."""
        out: list[TrackResult | BaseException] = []
        for req, ctx in zip(reqs, ctxs, strict=True):
            try:
                out.append(self.run(req, ctx))
            except Exception as exc:
                out.append(exc)
        return out

    def run(self, req: TrackRequest, ctx: TaskContext) -> TrackResult:
        if self.s.test_hang:  # fault injection: a model thread that stops making progress
            ctx.report("backbone", 1, 100, "hung")
            threading.Event().wait()
        steps = max(1, int(self.s.test_delay_s / 0.01))
        for i in range(steps):
            ctx.check()
            ctx.report(PHASES[min(2, 3 * i // steps)], i + 1, steps)
            if self.s.test_delay_s:
                time.sleep(self.s.test_delay_s / steps)
        seconds = req.duration * 60
        if self.s.test_max_audio_sec:  # load and fuzz tests: the schedule is the point, not the audio
            seconds = min(seconds, self.s.test_max_audio_sec)
        frames = max(1, int(seconds * SAMPLE_RATE / HOP))
        n = frames * HOP
        freq = 220.0 + (req.seed % 440)
        t = np.arange(n, dtype=np.float64) / SAMPLE_RATE
        tone = (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32)
        audio = np.stack([tone, tone], axis=1)
        meta = {
            "task_id": req.task_id,
            "job_id": req.job_id,
            "track_index": req.track_index,
            "seed": req.seed,
            "models": {"backbone": "test_tone", "superres": "test_tone"},
            "tokens": {"backbone_new": 2 * frames, "frames": frames},
            "timings": {"delay_sec": self.s.test_delay_s},
            "duration_sec": n / SAMPLE_RATE,
        }
        wav, mp3, js, meta = write_track(self.s.output_dir, audio, SAMPLE_RATE, meta, Mp3Options())
        return TrackResult(wav, mp3, js, n / SAMPLE_RATE, 2 * frames, req.seed, meta)
