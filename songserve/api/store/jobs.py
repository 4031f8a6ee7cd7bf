"""``Store``: the job store written once, over either engine's connector (``store/connector.py``).

It keeps the jobs and tracks (its SQL: ``store/queries/jobs.py``) and composes the other concerns'
repositories on the same connector, reached as attributes: ``outbox`` (``OutboxRepo``), ``uploads``
(``Uploads``), ``members`` (``Members``). What a state change writes beside its track (its webhook
events, the fence's lease check, a key's quota at insert) runs in the change's own transaction, with
those modules' helpers that take it (``insert_events``, ``holds``, ``check_quota``); the rules are
``store/protocol.py``'s. Each engine's store (``SqliteStore``, ``PgStore``) only opens its connector and
migrates it.

Every write to a job tells the other dispatchers (``Tx.notify``: PostgreSQL's ``NOTIFY``, delivered on
commit; nothing on SQLite). A claim locks the queued rows it wants, skipping those another dispatcher
is claiming (``FOR UPDATE SKIP LOCKED`` on PostgreSQL; SQLite's write lock serialises claims), so two
dispatchers never claim one track and neither waits on the other.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from songserve.api.jobs.records import Job, Key, Track
from songserve.api.jobs.states import TrackStatus
from songserve.api.store.adapters import Adapters
from songserve.api.store.connector import Conflict, Connector, Row, Tx, marks
from songserve.api.store.members import Fence, Members, holds
from songserve.api.store.outbox import OutboxRepo, insert_events
from songserve.api.store.protocol import (
    STORED_TRACK_FIELDS,
    DuplicateKey,
    Events,
    LeaseLost,
    StaleTrack,
    StoreError,
    job_from_row,
    stored_value,
    work_ratios,
)
from songserve.api.store.queries import jobs as q
from songserve.api.store.quota import Quota, Usage, check_quota, read_usage
from songserve.api.store.uploads import Uploads


class Store:
    """``JobStore`` over ``db``, one engine's connector; ``where`` names it in logs, ``ident`` is its own id."""

    def __init__(self, db: Connector, where: str, shared: bool) -> None:
        self.db = db
        self.where = where
        self.shared = shared
        self.ident = ""  # read from the store once it is migrated
        self.outbox = OutboxRepo(db)
        self.uploads = Uploads(db)
        self.adapters = Adapters(db)
        self.members = Members(db)

    async def read_ident(self) -> None:
        row = await self.db.fetch_one("SELECT value FROM store_meta WHERE name='store_id'")
        self.ident = str(row["value"]) if row else ""

    async def close(self) -> None:
        await self.db.close()

    # ---- jobs and tracks -----------------------------------------------------------------------
    async def insert_job(self, job: Job, quota: Quota | None = None) -> None:
        try:
            async with self.db.transaction() as tx:
                if job.idempotency_key and (found := await tx.fetch_one(q.BY_KEY, (job.idempotency_key,))):
                    raise DuplicateKey(found["job_id"])
                if quota is not None and quota.limited:
                    await check_quota(tx, quota, len(job.tracks), job.created_at)
                row = await tx.fetch_one(
                    self.db.dialect.pick(q.INSERT_JOB),
                    (
                        job.job_id,
                        job.created_at,
                        job.priority,
                        job.request.model_dump_json(),
                        job.cleaned_lyrics,
                        len(job.tracks),
                        job.idempotency_key,
                        job.caller,
                    ),
                )
                await tx.execute_many(q.INSERT_TRACK, [(t.job_id, t.index, t.status.value, t.seed) for t in job.tracks])
                await tx.notify(job.job_id)
        except Conflict as exc:  # another dispatcher stored the key between our look and our insert
            holder = await self.job_by_key(job.idempotency_key or "")
            if holder is None:
                raise StoreError(str(exc)) from exc
            raise DuplicateKey(holder) from None
        assert row is not None  # an INSERT … RETURNING returns its row
        job.seq = int(row["seq"])

    async def claim(self, tracks: list[Track], fence: Fence) -> set[int]:
        if not tracks:
            return set()
        job_id = tracks[0].job_id
        won: set[int] = set()
        async with self.db.transaction() as tx:
            if not await holds(tx, fence):
                raise LeaseLost(tracks[0].key, fence)
            indices = [t.index for t in tracks]
            lock = q.LOCK_QUEUED.replace("{indices}", marks(len(indices)))
            free = {int(r["idx"]) for r in await tx.fetch_all(lock, (job_id, *indices))}
            for t in tracks:  # in the order asked (the dispatcher's queue order)
                if t.index in free and await self._write_track(tx, t, (TrackStatus.queued, None)):
                    won.add(t.index)
            if won:
                await tx.notify(job_id)
        return won

    async def save_track(
        self, t: Track, seen: tuple[TrackStatus, str | None], fence: Fence | None = None, events: Events = ()
    ) -> None:
        async with self.db.transaction() as tx:
            if fence is not None and not await holds(tx, fence):
                raise LeaseLost(t.key, fence)
            if not await self._write_track(tx, t, seen):
                raise StaleTrack(t.key)
            await insert_events(tx, events)
            await tx.notify(t.job_id)

    @staticmethod
    async def _write_track(tx: Tx, t: Track, seen: tuple[TrackStatus, str | None]) -> bool:
        values = [stored_value(t, f) for f in STORED_TRACK_FIELDS]
        return await tx.execute(q.WRITE_TRACK, (*values, t.job_id, t.index, seen[0].value, seen[1])) == 1

    async def save_progress(self, t: Track, fence: Fence | None = None) -> None:
        async with self.db.transaction() as tx:
            if fence is not None and not await holds(tx, fence):
                return
            params = (
                t.worker_phase,
                t.phase_progress,
                t.phase_detail,
                t.phase_rate,
                t.preview_sec,
                t.job_id,
                t.index,
                t.owner,
            )
            if await tx.execute(q.SAVE_PROGRESS, params):
                await tx.notify(t.job_id)

    async def mark_started(self, job_id: str, at: float, events: Events = ()) -> None:
        async with self.db.transaction() as tx:
            if await tx.execute(q.MARK_STARTED, (at, job_id)):
                await insert_events(tx, events)
                await tx.notify(job_id)

    async def mark_cancelled(self, job_id: str) -> None:
        await self._job_write(q.MARK_CANCELLED, job_id)

    async def delete_job(self, job_id: str) -> None:
        await self._job_write(q.DELETE, job_id)

    async def _job_write(self, sql: str, job_id: str) -> None:
        async with self.db.transaction() as tx:
            if await tx.execute(sql, (job_id,)):
                await tx.notify(job_id)

    async def finish_job(self, job_id: str, at: float, events: Events = ()) -> bool:
        async with self.db.transaction() as tx:
            if await tx.execute(q.FINISH, (at, job_id, job_id)):
                await insert_events(tx, events)
                await tx.notify(job_id)
                return True
            row = await tx.fetch_one(q.IS_TERMINAL, (job_id,))
        return bool(row and row["terminal"])

    async def is_cancelled(self, job_id: str) -> bool:
        row = await self.db.fetch_one(q.IS_CANCELLED, (job_id,))
        return bool(row and row["cancelled"])

    async def job_by_key(self, key: str) -> str | None:
        row = await self.db.fetch_one(q.BY_KEY, (key,))
        return str(row["job_id"]) if row else None

    async def load_job(self, job_id: str) -> Job | None:
        jobs, tracks = await self.db.read_together([(q.JOB, (job_id,)), (q.JOB_TRACKS, (job_id,))])
        return job_from_row(jobs[0], tracks) if jobs else None

    async def active_jobs(self) -> list[Job]:
        jobs, rows = await self.db.read_together([(q.ACTIVE, ()), (q.ACTIVE_TRACKS, ())])
        # Parsed in a thread: a thousand active jobs' requests and metadata took half a second of the
        # event loop. The loop still runs between the thread's slices of the GIL.
        return await asyncio.to_thread(_jobs_of, jobs, rows)

    async def running_on(self, worker_id: int) -> list[Key]:
        return [(r["job_id"], int(r["idx"])) for r in await self.db.fetch_all(q.RUNNING_ON, (worker_id,))]

    async def expired_jobs(self, older_than: float) -> list[str]:
        return [r["job_id"] for r in await self.db.fetch_all(q.EXPIRED, (older_than,))]

    async def finished_jobs_oldest_first(self) -> list[str]:
        return [r["job_id"] for r in await self.db.fetch_all(q.FINISHED_OLDEST_FIRST)]

    async def job_ids(self) -> set[str]:
        return {r["job_id"] for r in await self.db.fetch_all(q.IDS)}

    async def jobs_newest_first(self, caller: str | None, below: int | None, limit: int) -> list[tuple[str, int]]:
        where: list[tuple[str, object]] = [("seq < ?", below)] if below is not None else []
        where += [("caller = ?", caller)] if caller is not None else []
        sql = q.NEWEST_FIRST.replace("{where}", " WHERE " + " AND ".join(w for w, _ in where) if where else "")
        rows = await self.db.fetch_all(sql, (*(v for _, v in where), limit))
        return [(r["job_id"], int(r["seq"])) for r in rows]

    async def counts(self) -> dict[str, int]:
        return {r["status"]: int(r["n"]) for r in await self.db.fetch_all(q.COUNTS)}

    async def finished_work_ratios(self, limit: int = 200) -> list[tuple[str, float]]:
        rows = await self.db.fetch_all(q.WORK_RATIOS, (limit,))
        return work_ratios((r["metadata"], r["started_at"], r["finished_at"], r["duration_sec"]) for r in rows)

    async def usage(self, caller: str | None, since: float) -> Usage:
        return await read_usage(self.db, caller, since)

    # ---- events and one-at-a-time work ---------------------------------------------------------
    @asynccontextmanager
    async def listen(self, on_change: Callable[[str], None]) -> AsyncIterator[None]:
        async with self.db.listen(on_change):
            yield

    @asynccontextmanager
    async def exclusive(self, name: str) -> AsyncIterator[bool]:
        async with self.db.exclusive(name) as got:
            yield got

    async def probe(self, timeout: float) -> None:
        await self.db.probe(timeout)


def _jobs_of(jobs: list[Row], rows: list[Row]) -> list[Job]:
    """The ``Job`` of each jobs row, with its tracks from ``rows`` (any order)."""
    tracks: dict[str, list[Row]] = {}
    for t in rows:
        tracks.setdefault(t["job_id"], []).append(t)
    return [job_from_row(r, tracks.get(r["job_id"], [])) for r in jobs]
