"""The job store's interface: what the dispatcher keeps so that a restart, or another dispatcher, can go on.

One ``JobStore`` protocol (every method async), implemented once (``store/jobs.py``) over a narrow
connector per engine, with one repository per other concern reached as its attributes
(``store.outbox``, ``store.uploads``, ``store.members``; their protocols live beside their records):
- SQLite (``store/sqlite/store.py``, the default): one file under the state folder, nothing to install, one
  dispatcher; its statements run on a thread of its own, never on the event loop;
- PostgreSQL (``store/postgres/store.py``, ``STORE_URL=postgresql://…``): several dispatchers share one queue. A
  track is claimed by exactly one of them (``FOR UPDATE SKIP LOCKED``), each worker is leased to one
  dispatcher at a time (a lease row renewed by a heartbeat), and every change is announced with
  ``NOTIFY`` so the others can show it.

The rules both engines keep, so the dispatcher's code is the same over either:
- a track row changes only by compare-and-set on its (status, owner) as the writer last saw them
  (``save_track`` raises ``StaleTrack`` when another dispatcher changed it first);
- fencing: a claim, and every later write for a track on a worker, carries the ``Fence`` its writer
  holds (the worker's lease epoch), and the store checks it against the lease row, and the lease's
  expiry on the store's clock, in the write's own transaction (``LeaseLost`` otherwise). The epoch grows
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
from typing import Any, Protocol

from songserve.api.jobs.records import Job, Key, Track
from songserve.api.jobs.states import TrackStatus
from songserve.api.store.adapters import AdapterRows
from songserve.api.store.members import Fence, MemberStore
from songserve.api.store.outbox import Outbox, WebhookEvent
from songserve.api.store.quota import Quota, Usage
from songserve.api.store.uploads import UploadStore
from songserve.errors import SongserveError
from songserve.schemas import GenerateRequest

Events = Sequence[WebhookEvent]


STORED_TRACK_FIELDS = (
    "status",
    "seed",
    "attempts",
    "worker_id",
    "task_id",
    "owner",
    "error",
    "duration_sec",
    "started_at",
    "finished_at",
    "metadata",
    "worker_phase",
    "phase_progress",
    "phase_detail",
    "phase_rate",
    "preview_sec",
)


class StaleTrack(Exception):
    """A track changed in the store since this dispatcher read it (another dispatcher got there first)."""

    def __init__(self, key: Key) -> None:
        super().__init__(f"track {key[0]}/{key[1]} changed in the store meanwhile")
        self.key = key


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
    """The jobs and tracks, a key's usage, events and exclusive work; the other concerns are connectors
    of their own, each with its protocol: ``outbox`` (``store/outbox.py``), ``uploads``
    (``store/uploads.py``), ``adapters`` (``store/adapters.py``) and ``members`` (``store/members.py``: the registry, presence, leases)."""

    shared: bool  # several dispatchers may use it at once (events cross processes)
    where: str  # for logs: the file, or the server without its password
    ident: str  # the store's own id (random, kept in it): the namespace of its lease epochs on a worker

    @property
    def outbox(self) -> Outbox: ...
    @property
    def uploads(self) -> UploadStore: ...
    @property
    def adapters(self) -> AdapterRows: ...
    @property
    def members(self) -> MemberStore: ...

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
