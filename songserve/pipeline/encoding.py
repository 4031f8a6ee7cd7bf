"""One encoding on the worker's model thread: a person's audio into the code grid a song continues from.

Orchestration only, as ``pipeline.py`` is for songs: the encoder where ``RUNTIME_MODE`` keeps it
(``Residency.enter_encoder`` / ``end_encode``, however the encoding ends), progress by chunk into
the task's context (a cancel lands between chunks), and the result with its timings. The audio has
been read and resampled by then (``songserve/audio/reading.py``, off the model thread).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from songserve.pipeline.config import PipelineConfig
from songserve.pipeline.context import TaskContext
from songserve.pipeline.residency import Residency
from songserve.pipeline.types import EncodeResult

log = logging.getLogger(__name__)


def encode_audio(residency: Residency, s: PipelineConfig, audio: Any, ctx: TaskContext) -> EncodeResult:
    """audio: numpy (2, n) float32 at 44.1 kHz in [-1, 1] → ``EncodeResult`` (codes (64, frames) int16)."""
    t0 = time.perf_counter()
    ctx.report("encoding", 0, 1)
    encoder = residency.enter_encoder()
    cfg = encoder.cfg
    loaded = time.perf_counter()

    def on_chunk(done: int, total: int) -> None:
        ctx.check()
        ctx.report("encoding", done, total, f"chunk {done}/{total}")

    try:
        with torch.inference_mode():
            codes = encoder.encode(
                torch.from_numpy(np.asarray(audio, dtype=np.float32)),
                s.encode_chunk_frames,
                s.encode_context_frames,
                on_chunk,
            )
    finally:
        del encoder  # this frame's reference would keep the weights alive through one_shot's release
        residency.end_encode()
    done = time.perf_counter()
    seconds = audio.shape[1] / cfg.sample_rate
    log.info(
        "task %s: encoded %.2f s of audio into %d frames in %.2f s", ctx.task_id, seconds, codes.shape[1], done - loaded
    )
    timings = {"load_sec": round(loaded - t0, 4), "encode_sec": round(done - loaded, 4)}
    return EncodeResult(codes.numpy().astype(np.int16), cfg.frame_rate, cfg.hop, cfg.sample_rate, timings)
