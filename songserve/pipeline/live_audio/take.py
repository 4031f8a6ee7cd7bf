"""A take's live audio: the preview PCM a listener hears while the take is still being made.

One ``LiveAudio`` per take, shared by three threads: the pipeline (or its preview thread) appends
16-bit PCM to a file in the output folder, the worker's HTTP thread follows that file for its
listeners, and anyone asks for it with ``want()``. The audio goes to a file, not to memory: a
15-minute take is 159 MB of PCM, and a listener that reads slowly (or not at all) then costs
nothing but page cache; each listener reads at its own pace and the writer never waits for one.

States (``LiveState``), the legal moves in ``_MOVES``::

    idle ──want()──▶ wanted ──first audio──▶ live ──all of the take──▶ complete
      │                 │                      └──cancel / error────▶ failed
      └──── the take can no longer be previewed (its backbone ended first) ──▶ missed

``complete``, ``failed`` and ``missed`` are final. Nothing here imports torch: the tone pipeline
writes its live audio through the same object.
"""

from __future__ import annotations

import io
import logging
import threading
from enum import StrEnum
from pathlib import Path

import numpy as np
import soundfile as sf

log = logging.getLogger(__name__)
SUFFIX = ".live.pcm"  # <task_id>.live.pcm in the output folder (worker/outputs.py sweeps it too)


class LiveState(StrEnum):
    idle = "idle"
    wanted = "wanted"
    live = "live"
    complete = "complete"
    failed = "failed"
    missed = "missed"

    @property
    def final(self) -> bool:
        return self in (LiveState.complete, LiveState.failed, LiveState.missed)


_MOVES: dict[LiveState, set[LiveState]] = {
    LiveState.idle: {LiveState.wanted, LiveState.missed},
    LiveState.wanted: {LiveState.live, LiveState.complete, LiveState.failed, LiveState.missed},
    LiveState.live: {LiveState.complete, LiveState.failed},
}


class LiveAudio:
    """One take's live audio: its state, the file it is written to, and how much is there."""

    def __init__(self, task_id: str, sample_rate: int = 44_100, channels: int = 2) -> None:
        self.task_id = task_id
        self.sample_rate = sample_rate
        self.channels = channels
        self.path: Path | None = None  # set by ``open``: where the PCM is appended
        self.frames_written = 0  # sample frames (one per channel group) in the file
        self.error = ""
        self._state = LiveState.idle
        self._lock = threading.Lock()
        self._wanted = threading.Event()

    # -- any thread ------------------------------------------------------------------------------
    @property
    def state(self) -> LiveState:
        return self._state

    @property
    def bytes_written(self) -> int:
        return self.frames_written * self.channels * 2

    @property
    def seconds(self) -> float:
        return self.frames_written / self.sample_rate

    def want(self) -> LiveState:
        """Someone listens (or the request asked for a preview): the take is previewed from now on."""
        self._move(LiveState.wanted, only_from=LiveState.idle)
        self._wanted.set()
        return self._state

    def wanted(self) -> bool:
        return self._wanted.is_set()

    # -- the writer (the pipeline's threads) -----------------------------------------------------
    def open(self, folder: Path) -> None:
        """Create the (empty) file; called once, by the writer, before the first ``append``."""
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{self.task_id}{SUFFIX}"
        path.write_bytes(b"")
        self.path = path

    def append(self, audio: np.ndarray) -> None:
        """audio (samples, channels) float in [-1, 1] → 16-bit PCM at the end of the file."""
        assert self.path is not None, "open() first"
        samples = np.clip(np.asarray(audio, dtype=np.float32), -1.0, 1.0)
        pcm = io.BytesIO()  # libsndfile's own float → int16 rounding: the same samples the final WAV gets
        sf.write(pcm, samples, self.sample_rate, format="RAW", subtype="PCM_16", endian="LITTLE")
        with open(self.path, "ab") as f:
            f.write(pcm.getvalue())
        self.frames_written += int(samples.shape[0])
        self._move(LiveState.live, only_from=LiveState.wanted)

    def complete(self) -> None:
        self._move(LiveState.complete)

    def fail(self, why: str) -> None:
        self.error = why
        self._move(LiveState.failed)

    def close_window(self) -> None:
        """The take can no longer start a preview (its backbone is over, and whatever previewed it has
        finished): one that never started is missed, so a listener is told at once."""
        if self._state in (LiveState.idle, LiveState.wanted):
            self._move(LiveState.missed)

    def remove(self) -> None:
        """The take ended: its file goes (a listener that has it open reads on to its end)."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)

    def _move(self, to: LiveState, only_from: LiveState | None = None) -> None:
        with self._lock:
            now = self._state
            if now is to or (only_from is not None and now is not only_from):
                return
            if to not in _MOVES.get(now, set()):
                return  # final states stay; a late report of a finished take changes nothing
            self._state = to
        log.debug("task %s: live audio %s → %s", self.task_id, now.value, to.value)
