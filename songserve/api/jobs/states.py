"""Track and job states: the enums, the legal track transitions, and the job status derivation.

Track:   queued → generating → superres → decoding → done
           ↑  │        └──────────┴──────────┴──→ error | cancelled
           └──┘ (retry: a running track goes back to the queue)
A job's status is derived from its tracks (docs/api.md), never stored on its own. Which
running status a worker's phase means, and its weight in the overall percent: ``phases.py``, beside this.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum


class TrackStatus(StrEnum):
    queued = "queued"
    generating = "generating"
    superres = "superres"
    decoding = "decoding"
    done = "done"
    error = "error"
    cancelled = "cancelled"

    @property
    def running(self) -> bool:
        return self in RUNNING

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


class JobStatus(StrEnum):
    queued = "queued"
    pending = "pending"
    generating = "generating"
    completed = "completed"
    partial = "partial"
    failed = "failed"
    cancelled = "cancelled"


RUNNING = frozenset({TrackStatus.generating, TrackStatus.superres, TrackStatus.decoding})
TERMINAL = frozenset({TrackStatus.done, TrackStatus.error, TrackStatus.cancelled})
TERMINAL_JOB = frozenset({JobStatus.completed, JobStatus.partial, JobStatus.failed, JobStatus.cancelled})

_ALLOWED: dict[TrackStatus, frozenset[TrackStatus]] = {
    TrackStatus.queued: frozenset({TrackStatus.generating, TrackStatus.cancelled, TrackStatus.error}),
    **{s: RUNNING | TERMINAL | {TrackStatus.queued} for s in RUNNING},
    **{s: frozenset() for s in TERMINAL},
}


class IllegalTransition(RuntimeError):
    pass


def check_transition(old: TrackStatus, new: TrackStatus) -> None:
    if new != old and new not in _ALLOWED[old]:
        raise IllegalTransition(f"track cannot go from {old} to {new}")


def job_status(tracks: Iterable[TrackStatus], cancelled: bool) -> JobStatus:
    statuses = list(tracks)
    if cancelled:
        return JobStatus.cancelled
    if statuses and all(s is TrackStatus.done for s in statuses):
        return JobStatus.completed
    if statuses and all(s.terminal for s in statuses):
        done = sum(s is TrackStatus.done for s in statuses)
        return JobStatus.partial if done else JobStatus.failed
    if any(s.running for s in statuses):
        return JobStatus.generating
    if statuses and all(s is TrackStatus.queued for s in statuses):
        return JobStatus.queued
    return JobStatus.pending
