"""The test pipeline: a deterministic tone after a configurable delay, with the real export.

For scheduling and fault tests of the dispatcher (``--pipeline test``): it reports progress through
the same phases, honours cancellation, and writes real WAV/MP3/JSON files and a codes file: a
deterministic grid (``(seed + frame + level) mod 1024``) that starts with a request's prefix (for a
repaint: the original grid with each part from its start to its ``end`` written anew, joined at ``end``
exactly), so retakes and repaints can be routed and checked through the dispatcher at tone speed. Its audio stays a tone
(it has no decoder). Its ``encode`` is as deterministic: each frame's codes follow from that frame's
mean level (``tone_codes``), so uploads can be checked through the dispatcher at tone speed too.
Never a substitute for the model pipeline in its own tests.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import numpy as np

from songserve.errors import NotFoundError, RequestError
from songserve.pipeline.config import ToneConfig
from songserve.pipeline.context import TaskContext
from songserve.pipeline.numbers import CODEBOOK, FRAMES_PER_SECOND, HOP, SAMPLE_RATE, SUPERRES_LEVELS
from songserve.pipeline.stages.export import Mp3Options, write_track
from songserve.pipeline.types import EncodeResult, TrackRequest, TrackResult

PHASES = ("backbone", "superres", "decoding")


class TonePipeline:
    def __init__(self, settings: ToneConfig, max_batch: int = 1) -> None:
        self.s = settings
        self.max_batch = max_batch  # reported in /config, so the dispatcher's packing can be tested against a tone
        self.phase_hook: Callable[[str], None] = lambda phase: None

    def load(self) -> None:
        pass

    def loaded(self) -> dict[str, bool]:
        return {"backbone_loaded": True, "superres_loaded": True, "decoder_loaded": True, "encoder_loaded": True}

    def prefetch_adapters(self, names: list[str]) -> None:
        """The tone has no adapters (a take naming one is a tone all the same)."""

    def upload_adapter(self, name: str, config: IO[bytes], weights: IO[bytes]) -> dict[str, Any]:
        raise RequestError("This worker runs the test tone: it takes no adapter uploads.")

    def remove_adapter(self, name: str, sha256: str | None = None) -> None:
        raise NotFoundError(f"No uploaded adapter {name[:80]!r} on this worker.")

    def encode(self, audio: np.ndarray, ctx: TaskContext) -> EncodeResult:
        """``tone_codes`` of the audio, after a quarter of ``TEST_DELAY_S`` (an encoding is short work)."""
        steps = max(1, int(self.s.test_delay_s / 0.04))
        for i in range(steps):
            ctx.check()
            ctx.report("encoding", i + 1, steps)
            if self.s.test_delay_s:
                time.sleep(self.s.test_delay_s / 4 / steps)
        return EncodeResult(tone_codes(audio), FRAMES_PER_SECOND, HOP, SAMPLE_RATE, {"encode_sec": 0.0})

    def describe(self) -> dict[str, Any]:
        return {
            "backbone_models": ["default_backbone"],
            "superres_models": ["default_superres"],
            "sample_rate": SAMPLE_RATE,
            "frame_rate": round(FRAMES_PER_SECOND, 2),
            "test_pipeline": True,
            "encoder": True,
            "untrained": self.s.test_untrained,  # the page's banner, testable at tone speed
        }

    def limits(self) -> dict[str, Any]:
        return {"max_batch": self.max_batch}

    def run_batch(self, reqs: list[TrackRequest], ctxs: list[TaskContext]) -> list[TrackResult | BaseException]:
        """The takes in turn, each with its own outcome (a cancelled take does not stop the others)."""
        out: list[TrackResult | BaseException] = []
        for req, ctx in zip(reqs, ctxs, strict=True):
            try:
                got = self.run(req, ctx)
                got.metadata["batch_size"] = len(reqs)  # what the dispatcher's packing sent as one batch
                out.append(got)
            except Exception as exc:
                out.append(exc)
        return out

    def run(self, req: TrackRequest, ctx: TaskContext) -> TrackResult:
        if self.s.test_hang:  # fault injection: a model thread that stops making progress
            ctx.report("backbone", 1, 100, "hung")
            threading.Event().wait()
        seconds = req.duration * 60
        if self.s.test_max_audio_sec:  # load and fuzz tests: the schedule is the point, not the audio
            seconds = min(seconds, self.s.test_max_audio_sec)
        frames = max(1, int(seconds * SAMPLE_RATE / HOP))
        repaint = req.prefix.repaint if req.prefix is not None else None
        if req.prefix is not None and repaint is not None:
            frames = req.prefix.frames  # a repaint is as long as its original
        codes = (req.seed + np.arange(frames)[None, :] + np.arange(SUPERRES_LEVELS)[:, None]) % CODEBOOK
        if req.prefix is not None:
            if req.prefix.levels != SUPERRES_LEVELS or (repaint is None and req.prefix.frames >= frames):
                raise RequestError(
                    f"The prefix ({req.prefix.levels} × {req.prefix.frames}) does not fit a "
                    f"{SUPERRES_LEVELS} × {frames} grid."
                )
            kept = np.frombuffer(req.prefix.raw, dtype="<i2").reshape(SUPERRES_LEVELS, req.prefix.frames)
            if repaint is None:
                codes[:, : req.prefix.frames] = kept
            else:  # the original but each part, written anew (an opening, start 0, keeps nothing before)
                new = codes.copy()
                codes[:] = kept
                for part in req.prefix.repaints():
                    codes[:, part.start : part.end] = new[:, part.start : part.end]
        n = frames * HOP
        freq = 220.0 + (req.seed % 440)
        t = np.arange(n, dtype=np.float64) / SAMPLE_RATE
        tone = (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32)
        audio = np.stack([tone, tone], axis=1)
        self._delay(req, ctx, audio)
        meta: dict[str, Any] = {
            "task_id": req.task_id,
            "job_id": req.job_id,
            "track_index": req.track_index,
            "seed": req.seed,
            "models": {"backbone": "test_tone", "superres": "test_tone"},
            "tokens": {"backbone_new": 2 * frames, "frames": frames},
            "timings": {"delay_sec": self.s.test_delay_s},
            "duration_sec": n / SAMPLE_RATE,
        }
        offered = {"backbone": "default_backbone", "superres": "default_superres"}  # what describe() says
        head: dict[str, Any] = {
            "seed": req.seed,
            "models": offered,
            "frame_rate": FRAMES_PER_SECOND,
            "hop": HOP,
            "sample_rate": SAMPLE_RATE,
            "job_id": req.job_id,
            "track_index": req.track_index,
        }
        kept_frames = 0 if req.prefix is None else req.prefix.frames if repaint is None else repaint.start
        if req.prefix is not None and kept_frames > 0:
            meta["continued"] = {
                "frames": kept_frames,
                "at_sec": kept_frames / FRAMES_PER_SECOND,
                "origin": req.prefix.origin,
            }
            head["continued"] = meta["continued"]
        if req.prefix is not None and repaint is not None:
            parts = req.prefix.repaints()
            last = parts[-1]
            meta["repainted"] = {
                "start_frame": repaint.start,
                "end_frame": last.end,
                "join_frame": last.end,
                "window": repaint.window,
                "opening": repaint.opening,
                "origin": req.prefix.origin,
                "changed_samples": [repaint.start * HOP, last.end * HOP],
                "parts": [
                    {
                        "start_frame": p.start,
                        "end_frame": p.end,
                        "join_frame": p.end,
                        "changed_samples": [p.start * HOP, p.end * HOP],
                    }
                    for p in parts
                ],
            }
            head["repainted"] = meta["repainted"]
        if ctx.live.wanted():
            meta["live"] = {"state": ctx.live.state.value, "seconds": round(ctx.live.seconds, 3)}
        wav, mp3, js, meta = write_track(
            self.s.output_dir,
            audio,
            SAMPLE_RATE,
            meta,
            Mp3Options().tagged(req.tags or req.description, req.track_index, req.lyrics),
            codes=(codes, head),
        )
        return TrackResult(wav, mp3, js, n / SAMPLE_RATE, 2 * frames, req.seed, meta, meta["files"]["codes"])

    def _delay(self, req: TrackRequest, ctx: TaskContext, audio: np.ndarray) -> None:
        """The phases over ``TEST_DELAY_S``. Live audio, when wanted, is the tone itself, written in
        step with the backbone phase (its first third), as the model pipeline's preview is. Where the
        decoding would begin, the take waits while ``TEST_HOLD_FILE`` exists: a test keeps its tracks
        running for as long as it needs, instead of a delay long enough for a loaded machine."""
        steps = max(1, int(self.s.test_delay_s / 0.01))
        backbone_steps = max(1, steps // 3)
        hold_at = 2 * steps // 3
        live = ctx.live if self.s.preview_chunk_sec > 0 else None
        if live is not None and req.preview:
            live.want()
        try:
            for i in range(steps):
                ctx.check()
                if i == hold_at and self.s.test_hold_file:
                    self._hold(Path(self.s.test_hold_file), ctx)
                ctx.report(PHASES[min(2, 3 * i // steps)], i + 1, steps)
                if live is not None and live.wanted() and i < backbone_steps:
                    if live.path is None:
                        live.open(self.s.output_dir)
                    upto = len(audio) * (i + 1) // backbone_steps
                    live.append(audio[live.frames_written : upto])
                    if i + 1 == backbone_steps:
                        live.complete()
                if live is not None and i + 1 == backbone_steps:
                    live.close_window()
                if self.s.test_delay_s:
                    time.sleep(self.s.test_delay_s / steps)
        except BaseException as exc:
            ctx.live.fail(f"the take ended ({type(exc).__name__})")
            raise
        ctx.live.close_window()

    @staticmethod
    def _hold(path: Path, ctx: TaskContext) -> None:
        """Until ``path`` is gone; a cancel still ends the take."""
        while path.exists():
            ctx.check()
            time.sleep(0.02)


def tone_codes(audio: np.ndarray) -> np.ndarray:
    """(2, n) samples → (64, ⌊n / 2048⌋) int16 codes: level c of a frame is (⌊1000 · its mean |sample|⌋ + 7c) mod 1024."""
    frames = audio.shape[1] // HOP
    level = np.abs(audio[:, : frames * HOP]).reshape(audio.shape[0], frames, HOP).mean(axis=(0, 2))
    codes = (np.floor(level * 1000).astype(np.int64)[None, :] + 7 * np.arange(SUPERRES_LEVELS)[:, None]) % CODEBOOK
    out: np.ndarray = codes.astype(np.int16)
    return out
