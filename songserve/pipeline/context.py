"""Cooperative cancellation and progress for one task.

Stages call ``ctx.check()`` between tokens, passes and chunks, and ``ctx.report(...)`` to publish
progress; the worker's HTTP thread reads ``ctx.snapshot()`` while the model thread runs. A take's
live audio (``ctx.live``, ``live.py``) is shared the same way.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from songserve.errors import TaskCancelled
from songserve.pipeline.live_audio.take import LiveAudio


@dataclass
class Progress:
    phase: str = "idle"
    done: int = 0
    total: int = 0
    detail: str = ""
    rate: float | None = None  # tokens per second in the backbone (reported apart from the detail)
    updated_at: float = field(default_factory=time.time)  # wall clock, for people and /health
    updated_mono: float = field(default_factory=time.monotonic)  # for stall checks: immune to clock steps

    @property
    def percent(self) -> int:
        return int(100 * self.done / self.total) if self.total else 0


class TaskContext:
    """Shared between the model thread (writer) and the HTTP thread (reader)."""

    def __init__(self, task_id: str = "") -> None:
        self.task_id = task_id
        self._cancel = threading.Event()
        self._lock = threading.Lock()
        self._progress = Progress()
        self.live = LiveAudio(task_id)  # the take's preview audio, when someone wants it

    def cancel(self) -> None:
        self._cancel.set()

    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def check(self) -> None:
        """Raise ``TaskCancelled`` if the task was asked to stop."""
        if self._cancel.is_set():
            raise TaskCancelled(f"Task {self.task_id} was cancelled.")

    def report(self, phase: str, done: int, total: int, detail: str = "", rate: float | None = None) -> None:
        with self._lock:
            self._progress = Progress(phase, done, total, detail, rate)

    def snapshot(self) -> Progress:
        with self._lock:
            return self._progress
