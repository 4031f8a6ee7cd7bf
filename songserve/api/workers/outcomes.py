"""What a worker's answer means to the dispatcher, and the ways a call to a worker ends without one.

Kept apart from the translation (``workers/to_worker.py``) and the HTTP calls (``workers/client.py``) because
everyone on the dispatcher's side reads these words: the pool, the attempts, the artifact copy.

    done       the track finished; ``result`` names its files
    error      the model failed with a clear sentence (not retried), or the worker's own environment
               failed it (``environment``: disk, memory, writes; retried elsewhere)
    cancelled  the worker stopped the task (ours or its own shutdown)
    busy       the worker was running something else; the track never started
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from songserve.errors import SongserveError
from songserve.schemas import WorkerGenerateResult


class WorkerUnreachable(SongserveError):
    """No usable answer: connection refused or lost, a timeout, or a body that is not the contract."""


class WorkerFault(WorkerUnreachable):
    """The worker answered, but not as the contract says, so the fault is the worker's, not the track's:
    a body that is not JSON, wrong types, a 200 without a result's fields, or result files that are
    missing, short, damaged, over the size cap or not delivered by the download deadline. Charged to
    that worker (the breaker that benches it); the track runs elsewhere without losing an attempt.
    """


class WorkerBusy(SongserveError):
    """An encoding the worker could not take now (busy, draining, or it has no encoder): try another."""


class EncodeRefused(SongserveError):
    """The worker refused an upload's file itself (a 4xx that is not busy): another worker would too."""


class AdapterRefused(SongserveError):
    """The worker refused an uploaded adapter's files: ``field`` (``config``, ``weights``, ``name``) and why."""

    def __init__(self, field: str, reason: str, status: int) -> None:
        super().__init__(reason)
        self.field, self.reason, self.status = field, reason, status


class TaskLost(SongserveError):
    """The worker does not know the task (it restarted): the track must run again."""


class OutcomeKind(StrEnum):
    done = "done"
    error = "error"
    cancelled = "cancelled"
    busy = "busy"


@dataclass(frozen=True)
class Outcome:
    kind: OutcomeKind
    result: WorkerGenerateResult | None = None
    error: str = ""
    environment: bool = False  # the failure is the worker's (disk, memory, writes), not the track's
