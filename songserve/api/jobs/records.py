"""The records of a job and its tracks, as every part of the dispatcher names them.

The store keeps them (``store/protocol.py`` says how); the dispatcher changes them (``dispatch/``);
the views show them (``views.py``). Plain dataclasses: nothing here reads a file or a socket.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from songserve.api.jobs.states import TrackStatus
from songserve.schemas import GenerateRequest

Key = tuple[str, int]  # (job_id, track index)


@dataclass
class Track:
    job_id: str
    index: int
    seed: int
    status: TrackStatus = TrackStatus.queued
    attempts: int = 0
    worker_id: int = -1
    task_id: str | None = None
    owner: str | None = None  # the dispatcher that runs it (None while queued or finished)
    error: str | None = None
    duration_sec: float = 0.0
    started_at: float | None = None
    finished_at: float | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    # the worker's progress while it runs (stored, throttled, so any dispatcher can show it)
    worker_phase: str = "idle"  # a WorkerPhase word
    phase_progress: int = 0  # the worker's percent within that phase
    phase_detail: str = ""
    phase_rate: float | None = None  # tokens per second, in the backbone
    preview_sec: float = 0.0  # seconds of live audio the worker has made of it
    # live, not stored
    queued_at: float = 0.0  # when it last entered the queue (0: since its job was created)
    avoid_worker: int = -1  # its last attempt failed there for an environment reason: prefer another
    env_failures: int = 0  # attempts that failed for environment reasons (not counted as attempts)

    @property
    def key(self) -> Key:
        return (self.job_id, self.index)


@dataclass
class Job:
    job_id: str
    seq: int  # submission order, given by the store
    created_at: float
    request: GenerateRequest  # as accepted (after normalisation)
    cleaned_lyrics: str
    tracks: list[Track]
    priority: int = 0
    cancelled: bool = False
    terminal: bool = False  # every track ended and the job is finished in the store
    started_at: float | None = None
    finished_at: float | None = None
    idempotency_key: str | None = None
    caller: str | None = None  # the name of the API key that submitted it (None: no key)

    # The job's own times are written after its tracks' (separate writes), so a reader can see a
    # track started or every track ended before the job says so; these answer from the tracks then.
    def start_time(self) -> float | None:
        """When its first track started."""
        if self.started_at is not None:
            return self.started_at
        return min((t.started_at for t in self.tracks if t.started_at is not None), default=None)

    def end_time(self) -> float | None:
        """When its last track ended, once every track has (None while any runs or waits)."""
        if self.finished_at is not None or not all(t.status.terminal for t in self.tracks):
            return self.finished_at
        return max((t.finished_at for t in self.tracks if t.finished_at is not None), default=None)
