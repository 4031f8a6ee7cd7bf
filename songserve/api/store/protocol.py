"""The job store's interface: what the dispatcher keeps so that a restart, or another dispatcher, can go on.

Two engines behind one ``JobStore`` protocol (every method async):
- SQLite (``store/sqlite/store.py``, the default): one file under the state folder, nothing to install, one
  dispatcher;
- PostgreSQL (``store/postgres/store.py``, ``STORE_URL=postgresql://…``): several dispatchers share one queue. A
  track is claimed by exactly one of them (``FOR UPDATE SKIP LOCKED``), each worker is leased to one
  dispatcher at a time (a lease row renewed by a heartbeat), and every change is announced with
  ``NOTIFY`` so the others can show it.

The rules both engines keep, so the dispatcher's code is the same over either:
- a track row changes only by compare-and-set on its (status, owner) as the writer last saw them
  (``save_track`` raises ``StaleTrack`` when another dispatcher changed it first);
- fencing: a claim, and every later write for a track on a worker, carries the ``Fence`` its writer
  holds (the worker's lease epoch), and the engine checks it against the lease row, and the lease's
  expiry on the store's clock, in the same statement (``LeaseLost`` otherwise). The epoch grows
  whenever a lease changes hands or is re-taken after it expired, so a dispatcher that was paused past
  its lease cannot write for a track under a lease it no longer holds, whatever its memory says;
- a queued track leaves the queue only through ``claim`` (or ``save_track`` to cancelled/error);
- a job is finished in the store when its last track is terminal (``finish_job``), whoever ran it;
- a webhook event is written in the transaction of the change it reports, and only when that change
  is made (a track's terminal write, a job's first start, its finish); the outbox's rules: ``store/outbox.py``;
- a key's quota is checked in the transaction that inserts the job it admits (``store/quota.py``);
- times are seconds since the epoch; lease expiry is measured on the store's clock.
"""

from __future__ import annotations

import contextvars
import json
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from songserve.api.jobs.records import Job, Key, Track
from songserve.api.jobs.states import TrackStatus
from songserve.api.store.outbox import Delivery, OutboxStats, WebhookEvent
from songserve.api.store.quota import Quota, Usage
from songserve.api.store.uploads import UploadRecord
from songserve.errors import SongserveError
from songserve.schemas import GenerateRequest

Events = Sequence[WebhookEvent]


STORED_TRACK_FIELDS = (
    "status", "seed", "attempts", "worker_id", "task_id", "owner", "error", "duration_sec", "started_at",
    "finished_at", "metadata", "worker_phase", "phase_progress", "phase_detail", "phase_rate", "preview_sec",
)  # fmt: skip


@dataclass(frozen=True)
class WorkerRow:
    """A worker in the shared registry: configured on a dispatcher (static) or announced by itself."""

    worker_id: int
    url: str
    announced: bool
    lease_owner: str | None  # the dispatcher that may send it tasks now (None: free or expired)


class StaleTrack(Exception):
    """A track changed in the store since this dispatcher read it (another dispatcher got there first)."""

    def __init__(self, key: Key) -> None:
        super().__init__(f"track {key[0]}/{key[1]} changed in the store meanwhile")
        self.key = key


@dataclass(frozen=True)
class Fence:
    """The lease a write is made under: ``owner`` holds ``worker_id``'s lease at ``epoch``."""

    owner: str
    worker_id: int
    epoch: int

    def __str__(self) -> str:
        return f"worker {self.worker_id} lease epoch {self.epoch}"


class LeaseLost(StaleTrack):
    """A write's fence failed in the store: the lease it was made under expired or passed to another
    dispatcher. The writer stops acting for the track at once; the lease's holder owns it now."""

    def __init__(self, key: Key, fence: Fence) -> None:
        Exception.__init__(self, f"track {key[0]}/{key[1]}: {fence} is no longer held by {fence.owner}")
        self.key, self.fence = key, fence


class DuplicateKey(Exception):
    """The Idempotency-Key belongs to a job already stored (perhaps submitted at another dispatcher)."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"the Idempotency-Key belongs to job {job_id}")
        self.job_id = job_id


class StoreError(SongserveError):
    """The store could not be reached or could not write (disk full, I/O error, connection lost).

    A request that meets it gets 503 with Retry-After (the error body of api.md), never a bare 500.
    """

    http_status = 503
    headers = {"Retry-After": "5"}

    def __str__(self) -> str:
        return f"The job store is unavailable ({self.args[0] if self.args else 'no answer'}); try again shortly."


class JobStore(Protocol):
    shared: bool  # several dispatchers may use it at once (events cross processes)
    where: str  # for logs: the file, or the server without its password
    ident: str  # the store's own id (random, kept in it): the namespace of its lease epochs on a worker

    async def close(self) -> None: ...

    # jobs and tracks
    async def insert_job(self, job: Job, quota: Quota | None = None) -> None:
        """Store a new job and its tracks in one transaction; sets ``job.seq``. Raises ``DuplicateKey``,
        and ``OverQuota`` when ``quota`` (its key's, checked in the same transaction) does not admit it."""

    async def claim(self, tracks: list[Track], fence: Fence) -> set[int]:
        """Claim queued tracks of one job for the worker ``fence`` names, in the given order, skipping
        any another dispatcher holds; raises ``LeaseLost`` (nothing claimed) when the fence fails.

        ``tracks`` carry the state to write (running, owned by the claimer); returns the indices won."""

    async def save_track(
        self, t: Track, seen: tuple[TrackStatus, str | None], fence: Fence | None = None, events: Events = ()
    ) -> None:
        """Write ``t`` if its row still has the (status, owner) ``seen`` and, with a ``fence``, the
        lease is still held as it says; else raise ``StaleTrack`` (``LeaseLost`` for the fence).
        ``events`` are written with it, or not at all."""

    async def save_progress(self, t: Track, fence: Fence | None = None) -> None:
        """Write the worker's progress of a running track (the owner's throttled updates); a write
        whose fence fails changes nothing (the next state change says why)."""

    async def mark_started(self, job_id: str, at: float, events: Events = ()) -> None:
        """The job's start time, if it has none yet; ``events`` are written only then."""

    async def mark_cancelled(self, job_id: str) -> None: ...

    async def finish_job(self, job_id: str, at: float, events: Events = ()) -> bool:
        """Mark the job terminal if every track is; returns whether it is terminal now. ``events`` are
        written only by the call that makes it terminal."""

    async def is_cancelled(self, job_id: str) -> bool: ...
    async def job_by_key(self, key: str) -> str | None: ...
    async def load_job(self, job_id: str) -> Job | None: ...
    async def active_jobs(self) -> list[Job]: ...
    async def running_on(self, worker_id: int) -> list[Key]: ...
    async def expired_jobs(self, older_than: float) -> list[str]: ...
    async def finished_jobs_oldest_first(self) -> list[str]: ...
    async def job_ids(self) -> set[str]: ...
    async def jobs_newest_first(self, caller: str | None, below: int | None, limit: int) -> list[tuple[str, int]]:
        """(job id, seq) of up to ``limit`` jobs, newest first, with ``seq`` below ``below`` when given;
        only the key named ``caller``'s when given (None: every job)."""

    async def delete_job(self, job_id: str) -> None: ...
    async def counts(self) -> dict[str, int]: ...
    async def finished_work_ratios(self, limit: int = 200) -> list[tuple[str, float]]: ...
    async def usage(self, caller: str | None, since: float) -> Usage:
        """A key name's unfinished jobs, and its jobs submitted after ``since`` (None: jobs without a key)."""

    # the webhook outbox (store/outbox.py)
    async def add_progress_event(self, event: WebhookEvent, min_gap: float) -> bool:
        """Write a progress event unless the job has one from the last ``min_gap`` seconds or is finished."""

    async def claim_events(self, owner: str, limit: int, lease_sec: float) -> list[Delivery]:
        """Lease up to ``limit`` due events to ``owner``, each the oldest pending one of its job."""

    async def event_delivered(self, row: int) -> None: ...
    async def event_failed(self, row: int, owner: str, error: str, retry_in: float | None) -> None:
        """A failed try of ``owner``'s: tried again in ``retry_in`` seconds, or (None) given up."""

    async def release_events(self, owner: str) -> None:
        """``owner`` starts again: its leases on events end (nothing of it is sending any more)."""

    async def outbox_stats(self) -> OutboxStats: ...
    async def sweep_events(self, ended_before: float) -> int:
        """Remove delivered and given-up events that ended before ``ended_before``; returns how many."""

    # workers, dispatchers and leases
    async def register_worker(self, url: str, ttl: float, announced: bool) -> int:
        """Add or renew a worker's registration for ``ttl`` seconds; returns its id (stable per URL)."""

    async def withdraw_worker(self, worker_id: int) -> bool: ...
    async def live_workers(self) -> list[WorkerRow]: ...

    async def heartbeat(self, dispatcher_id: str, ttl: float) -> set[str]:
        """Renew this dispatcher's presence; returns the ids of the live dispatchers (itself included)."""

    async def leave(self, dispatcher_id: str) -> None:
        """This dispatcher stops: its presence and its leases end now."""

    async def renew_leases(self, owner: str, ttl: float) -> dict[int, int]:
        """Extend the leases ``owner`` still holds (unexpired); returns worker id → lease epoch."""

    async def acquire_lease(self, owner: str, worker_id: int, ttl: float) -> int | None:
        """Take the worker's lease if it is free, expired or already ours; returns its epoch (≥ 1),
        one higher than before unless ``owner`` held it unexpired, or None when another holds it."""

    async def release_lease(self, owner: str, worker_id: int) -> None: ...

    # uploads (store/uploads.py: the rules)
    async def insert_upload(self, u: UploadRecord) -> None: ...
    async def load_upload(self, upload_id: str) -> UploadRecord | None: ...
    async def queued_uploads(self, limit: int) -> list[UploadRecord]:
        """The oldest queued uploads first."""

    async def claim_upload(self, upload_id: str, fence: Fence) -> bool:
        """``queued`` → ``encoding`` on the worker ``fence`` names, while its lease holds; whether it was won."""

    async def finish_upload(self, u: UploadRecord, owner: str) -> bool:
        """Write ``u``'s end (``ready`` with its frames, or ``failed`` with its error) if ``owner`` still encodes it."""

    async def requeue_upload(self, upload_id: str, owner: str, error: str, count: bool = True) -> bool:
        """``encoding`` → ``queued`` if ``owner`` encodes it; ``count`` False: the try is not counted."""

    async def requeue_stale_uploads(self, alive: set[str], me: str, running: set[str]) -> int:
        """Uploads left ``encoding`` by a dispatcher not in ``alive``, or by ``me`` with no attempt in
        ``running``, back to the queue; returns how many."""

    async def delete_upload(self, upload_id: str) -> bool: ...
    async def expired_uploads(self, older_than: float) -> list[str]: ...
    async def finished_oldest_first(self) -> list[tuple[str, str]]:
        """Finished jobs and uploads, oldest first: (``job`` or ``upload``, its id)."""

    async def upload_ids(self) -> set[str]: ...
    async def upload_counts(self) -> dict[str, int]: ...

    # events and one-at-a-time work
    def listen(self, on_change: Callable[[str], None]) -> AbstractAsyncContextManager[None]:
        """While entered, ``on_change(job_id)`` is called for changes made by other dispatchers."""

    def exclusive(self, name: str) -> AbstractAsyncContextManager[bool]:
        """Yields True to the one dispatcher that holds ``name`` now (retention sweeps), False to the others."""

    async def probe(self, timeout: float) -> None:
        """Could a write to the job tables start within ``timeout`` seconds? Raises ``StoreError`` saying
        why not (a table locked, no connection); changes nothing. ``/ready`` asks it every second."""


# Which of the store's connections a call uses (PostgreSQL): the background loops and the attempts
# keep a pool of their own, so routes stalled on the store cannot take every connection from them.
BACKGROUND: contextvars.ContextVar[bool] = contextvars.ContextVar("songserve_store_background", default=False)


def background_context() -> contextvars.Context:
    """A context for ``asyncio.create_task(..., context=…)``: the task's store calls use the loops' pool."""
    ctx = contextvars.copy_context()
    ctx.run(BACKGROUND.set, True)
    return ctx


def work_ratios(rows: Iterable[tuple[str, float, float, float]]) -> list[tuple[str, float]]:
    """(backbone model, wall seconds per audio second) from (metadata JSON, started, finished, duration)."""
    out = []
    for metadata, started, finished, duration in rows:
        model = json.loads(metadata).get("models", {}).get("backbone", "")
        out.append((model, (finished - started) / duration))
    return out


def job_from_row(row: Any, tracks: Iterable[Any]) -> Job:
    """A ``Job`` from a jobs row and its tracks rows (both engines' rows read by column name)."""
    return Job(
        job_id=row["job_id"],
        seq=int(row["seq"]),
        created_at=row["created_at"],
        request=GenerateRequest.model_validate_json(row["request"]),
        cleaned_lyrics=row["cleaned_lyrics"],
        priority=row["priority"],
        cancelled=bool(row["cancelled"]),
        terminal=bool(row["terminal"]),
        started_at=row["started_at"],
        finished_at=row["finished_at"],
        idempotency_key=row["idempotency_key"],
        caller=row["caller"],
        tracks=[
            Track(
                job_id=t["job_id"],
                index=t["idx"],
                seed=t["seed"],
                status=TrackStatus(t["status"]),
                attempts=t["attempts"],
                worker_id=t["worker_id"],
                task_id=t["task_id"],
                owner=t["owner"],
                error=t["error"],
                duration_sec=t["duration_sec"],
                started_at=t["started_at"],
                finished_at=t["finished_at"],
                metadata=json.loads(t["metadata"]) if isinstance(t["metadata"], str) else t["metadata"],
                worker_phase=t["worker_phase"],
                phase_progress=t["phase_progress"],
                phase_detail=t["phase_detail"],
                phase_rate=t["phase_rate"],
                preview_sec=t["preview_sec"] or 0.0,
            )
            for t in tracks
        ],
    )


def stored_value(t: Track, name: str) -> object:
    """A track field as both engines store it (status by value, metadata as JSON text)."""
    value = getattr(t, name)
    if name == "metadata":
        return json.dumps(value)
    if name == "status":
        return value.value
    return value
