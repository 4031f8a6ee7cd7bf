"""The PostgreSQL engine of the job store: several dispatchers, one queue (``STORE_URL=postgresql://…``).

Through psycopg 3 with an async connection pool; every method is one short transaction.
- Claims: ``claim`` locks the queued rows it wants with ``FOR UPDATE SKIP LOCKED`` in the order the
  dispatcher asks (its queue order), so two dispatchers never claim one track and neither waits on
  the other; rows another dispatcher holds or already took are skipped.
- Compare-and-set writes: a track row is written only while its (status, owner) are what the writer
  last saw (``StaleTrack`` otherwise), and, fenced, while the lease it was made under still holds,
  checked in the same statement against the lease row (``LeaseLost`` otherwise; ``lease_cte`` of the
  membership connector).
- Each other concern is a small connector on the same connections, reached as an attribute:
  ``outbox`` (``store/postgres/outbox.py``), ``uploads`` (``uploads.py``), ``members`` (``members.py``:
  the registry, presence, leases and their epochs).
- Two pools: one for the routes and one for the background loops and attempts (``PgLanes`` in
  ``conn.py``: ``BACKGROUND`` picks), so routes stalled on a locked table cannot take every connection
  the loops need.
- Leases and presence are timed on the database's clock, so hosts' clocks need not agree.
- Events: every write to a job sends ``NOTIFY songserve_jobs, '<origin>|<job_id>'`` in its
  transaction (delivered on commit); ``listen`` keeps one connection of its own on ``LISTEN`` and
  reconnects with a back-off, asking for a full resync (``*``) after any gap.
- ``exclusive`` is a session advisory lock: one dispatcher at a time sweeps retention.
- ``probe`` asks for the lock every write takes on the job tables, under a short lock timeout, and
  lets it go: a table locked by anyone turns ``/ready`` red within seconds.
- Webhook events ride in the statement of the change they report (the outbox connector's
  ``events_cte``); a key's quota is checked in the insert's transaction (``store/postgres/quota.py``).
- The pooled connections, their time limits and what a dead one means: ``store/postgres/conn.py``.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import psycopg
from psycopg import errors as pg_errors
from psycopg.rows import dict_row
from psycopg_pool import PoolTimeout

from songserve.api.jobs.records import Job, Key, Track
from songserve.api.jobs.states import RUNNING, TERMINAL, TrackStatus
from songserve.api.store.members import Fence
from songserve.api.store.migrations import NewerSchemaError
from songserve.api.store.postgres.conn import PgLanes, StoreLimits, redact
from songserve.api.store.postgres.members import PgMembers, lease_cte
from songserve.api.store.postgres.migrations import migrate
from songserve.api.store.postgres.outbox import PgOutbox, events_cte
from songserve.api.store.postgres.quota import USAGE, check_quota, usage_from_row
from songserve.api.store.postgres.uploads import PgUploads
from songserve.api.store.protocol import (
    STORED_TRACK_FIELDS,
    DuplicateKey,
    Events,
    LeaseLost,
    StaleTrack,
    job_from_row,
    stored_value,
    work_ratios,
)
from songserve.api.store.quota import Quota, Usage
from songserve.errors import ConfigError

log = logging.getLogger(__name__)
CHANNEL = "songserve_jobs"
TERMINAL_VALUES = [s.value for s in TERMINAL]
TRACK_COLUMN_TYPES = {
    "status": "text", "seed": "bigint", "attempts": "int", "worker_id": "int", "task_id": "text", "owner": "text",
    "error": "text", "duration_sec": "float8", "started_at": "float8", "finished_at": "float8", "metadata": "text",
    "worker_phase": "text", "phase_progress": "int", "phase_detail": "text", "phase_rate": "float8",
    "preview_sec": "float8",
}  # fmt: skip
# A job row with its tracks as one JSON array: one round trip for a whole job.
JOB_WITH_TRACKS = (
    "SELECT j.*, COALESCE((SELECT json_agg(t ORDER BY t.idx) FROM tracks t WHERE t.job_id = j.job_id), '[]')"
    " AS tracks FROM jobs j"
)
RUNNING_VALUES = [s.value for s in RUNNING]


# Schema steps may rewrite a table and wait for another dispatcher's migration: limits of their own.
MIGRATION_LIMITS = StoreLimits(statement_timeout_sec=600.0, lock_timeout_sec=120.0)


class PgStore:
    """The PostgreSQL engine of ``JobStore``: jobs and tracks, with its connectors on the same pools."""

    shared = True

    def __init__(self, url: str, origin: str, pool_size: int = 10, limits: StoreLimits | None = None) -> None:
        self.url = url
        self.where = redact(url)
        self.origin = origin  # this dispatcher's id: its own NOTIFYs are not news to it
        self.limits = limits or StoreLimits()
        self.ident = ""  # read at open
        self.db = PgLanes(url, pool_size, self.limits)
        self.outbox = PgOutbox(self.db)
        self.uploads = PgUploads(self.db)
        self.members = PgMembers(self.db)

    @classmethod
    async def open(
        cls, url: str, origin: str, pool_size: int = 10, timeout: float = 10.0, limits: StoreLimits | None = None
    ) -> PgStore:
        """Connect and migrate; a store that cannot be used raises ``ConfigError`` in one line."""
        store = cls(url, origin, pool_size, limits)
        try:
            # One plain connection first: a wrong URL fails once, in one line, not in the pool's retries.
            async with await psycopg.AsyncConnection.connect(
                url, autocommit=True, row_factory=dict_row, connect_timeout=max(1, int(timeout)),
                options=MIGRATION_LIMITS.options(url),
            ) as conn:  # fmt: skip
                await migrate(conn)
                row = await (await conn.execute("SELECT value FROM store_meta WHERE name='store_id'")).fetchone()
                store.ident = str(row["value"]) if row else ""
            await store.db.open(timeout)
        except NewerSchemaError as exc:
            await store.close()
            raise ConfigError(exc.refusal(store.where, "STORE_URL at another database")) from None
        except (psycopg.Error, PoolTimeout) as exc:
            await store.close()
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"The job store {store.where} cannot be opened ({first}).") from None
        return store

    async def close(self) -> None:
        await self.db.close()

    def _announcing(self, write: str) -> str:
        """``write`` (an UPDATE/DELETE … RETURNING job_id) and its NOTIFY as one statement."""
        return f"WITH w AS ({write}) SELECT w.job_id, pg_notify('{CHANNEL}', %s || '|' || w.job_id) FROM w"

    # ---- jobs and tracks -----------------------------------------------------------------------
    async def insert_job(self, job: Job, quota: Quota | None = None) -> None:
        sql = (
            "WITH j AS (INSERT INTO jobs (job_id, created_at, priority, request, cleaned_lyrics, num_tracks,"
            " idempotency_key, caller) VALUES (%s, %s, %s, %s, %s, %s, %s, %s) RETURNING job_id, seq),"
            " t AS (INSERT INTO tracks (job_id, idx, status, seed)"
            " SELECT j.job_id, x.idx, x.status, x.seed FROM j, unnest(%s::int[], %s::text[], %s::bigint[])"
            " AS x(idx, status, seed))"
            f" SELECT j.seq, pg_notify('{CHANNEL}', %s || '|' || j.job_id) FROM j"
        )
        params = (job.job_id, job.created_at, job.priority, job.request.model_dump_json(), job.cleaned_lyrics,
                  len(job.tracks), job.idempotency_key, job.caller, [t.index for t in job.tracks],
                  [t.status.value for t in job.tracks], [t.seed for t in job.tracks], self.origin)  # fmt: skip
        try:
            if quota is None or not quota.limited:
                rows = await self.db.rows(sql, params)
            else:  # the key's count and the insert in one transaction, one key name at a time
                async with self.db.tx() as conn:
                    await check_quota(conn, quota, len(job.tracks), job.created_at)
                    rows = await (await conn.execute(sql, params)).fetchall()
        except pg_errors.UniqueViolation:
            found = await self.job_by_key(job.idempotency_key or "")
            if found is None:
                raise
            raise DuplicateKey(found) from None
        job.seq = int(rows[0]["seq"])

    async def claim(self, tracks: list[Track], fence: Fence) -> set[int]:
        """One statement: check the fence, lock the wanted rows still queued (``SKIP LOCKED``, in the
        given order), write each one's new state, and NOTIFY, all in one round trip."""
        if not tracks:
            return set()
        columns = ", ".join(STORED_TRACK_FIELDS)
        arrays = ", ".join(f"%s::{TRACK_COLUMN_TYPES[f]}[]" for f in STORED_TRACK_FIELDS)
        sets = ", ".join(f"{f}=w.{f}" for f in STORED_TRACK_FIELDS)
        lease, lease_params = lease_cte(fence)
        rows = await self.db.rows(
            f"WITH {lease},"
            f" w AS (SELECT * FROM unnest(%s::int[], {arrays}) WITH ORDINALITY AS w(idx, {columns}, ord)),"
            " locked AS (SELECT t.idx FROM tracks t JOIN w ON t.idx = w.idx WHERE t.job_id=%s AND t.status='queued'"
            " AND EXISTS (SELECT 1 FROM lease) ORDER BY w.ord FOR UPDATE OF t SKIP LOCKED),"
            f" claimed AS (UPDATE tracks t SET {sets} FROM w WHERE t.job_id=%s AND t.idx = w.idx"
            " AND t.idx IN (SELECT idx FROM locked) RETURNING t.idx),"
            f" n AS (SELECT pg_notify('{CHANNEL}', %s || '|' || %s) WHERE EXISTS (SELECT 1 FROM claimed))"
            " SELECT (SELECT count(*) FROM lease) AS held, ARRAY(SELECT idx FROM claimed) AS won,"
            " (SELECT count(*) FROM n) AS sent",
            [
                *lease_params,
                [t.index for t in tracks],
                *([stored_value(t, f) for t in tracks] for f in STORED_TRACK_FIELDS),
                tracks[0].job_id,
                tracks[0].job_id,
                self.origin,
                tracks[0].job_id,
            ],
        )
        if not rows[0]["held"]:
            raise LeaseLost(tracks[0].key, fence)
        return {int(i) for i in rows[0]["won"]}

    async def save_track(
        self, t: Track, seen: tuple[TrackStatus, str | None], fence: Fence | None = None, events: Events = ()
    ) -> None:
        """One statement: the fence, the compare-and-set, the NOTIFY and the events."""
        sets = ", ".join(f"{f}=%s" for f in STORED_TRACK_FIELDS)
        lease, lease_params = lease_cte(fence)
        written, event_params = events_cte(events, "w")
        rows = await self.db.rows(
            f"WITH {lease}, w AS (UPDATE tracks SET {sets} WHERE job_id=%s AND idx=%s AND status=%s"
            " AND owner IS NOT DISTINCT FROM %s AND EXISTS (SELECT 1 FROM lease) RETURNING job_id),"
            f" n AS (SELECT pg_notify('{CHANNEL}', %s || '|' || w.job_id) FROM w){written}"
            " SELECT (SELECT count(*) FROM lease) AS held, (SELECT count(*) FROM n) AS written",
            [
                *lease_params,
                *(stored_value(t, f) for f in STORED_TRACK_FIELDS),
                t.job_id,
                t.index,
                seen[0].value,
                seen[1],
                self.origin,
                *event_params,
            ],
        )
        if fence is not None and not rows[0]["held"]:
            raise LeaseLost(t.key, fence)
        if not rows[0]["written"]:
            raise StaleTrack(t.key)

    async def save_progress(self, t: Track, fence: Fence | None = None) -> None:
        lease, lease_params = lease_cte(fence)
        await self.db.rows(
            f"WITH {lease}, w AS (UPDATE tracks SET worker_phase=%s, phase_progress=%s, phase_detail=%s,"
            " phase_rate=%s, preview_sec=%s WHERE job_id=%s AND idx=%s AND owner IS NOT DISTINCT FROM %s"
            " AND EXISTS (SELECT 1 FROM lease) RETURNING job_id)"
            f" SELECT w.job_id, pg_notify('{CHANNEL}', %s || '|' || w.job_id) FROM w",
            (*lease_params, t.worker_phase, t.phase_progress, t.phase_detail, t.phase_rate, t.preview_sec, t.job_id,
             t.index, t.owner, self.origin),
        )  # fmt: skip

    async def _job_write(self, sql: str, params: tuple[Any, ...]) -> None:
        await self.db.rows(self._announcing(sql + " RETURNING job_id"), (*params, self.origin))

    async def mark_started(self, job_id: str, at: float, events: Events = ()) -> None:
        written, event_params = events_cte(events, "w")
        await self.db.rows(
            "WITH w AS (UPDATE jobs SET started_at=%s WHERE job_id=%s AND started_at IS NULL RETURNING job_id)"
            f"{written} SELECT w.job_id, pg_notify('{CHANNEL}', %s || '|' || w.job_id) FROM w",
            [at, job_id, *event_params, self.origin],
        )

    async def mark_cancelled(self, job_id: str) -> None:
        await self._job_write("UPDATE jobs SET cancelled=true WHERE job_id=%s", (job_id,))

    async def finish_job(self, job_id: str, at: float, events: Events = ()) -> bool:
        written, event_params = events_cte(events, "u")
        rows = await self.db.rows(
            "WITH u AS (UPDATE jobs SET terminal=true, finished_at=COALESCE(finished_at, %s) WHERE job_id=%s"
            " AND NOT terminal AND NOT EXISTS (SELECT 1 FROM tracks WHERE job_id=%s AND status <> ALL(%s))"
            f" RETURNING job_id), n AS (SELECT pg_notify('{CHANNEL}', %s || '|' || job_id) FROM u){written}"
            " SELECT (SELECT count(*) FROM n) > 0 OR COALESCE((SELECT terminal FROM jobs WHERE job_id=%s), false)"
            " AS terminal",
            [at, job_id, job_id, TERMINAL_VALUES, self.origin, *event_params, job_id],
        )
        return bool(rows and rows[0]["terminal"])

    async def is_cancelled(self, job_id: str) -> bool:
        rows = await self.db.read("SELECT cancelled FROM jobs WHERE job_id=%s", (job_id,))
        return bool(rows and rows[0]["cancelled"])

    async def job_by_key(self, key: str) -> str | None:
        rows = await self.db.read("SELECT job_id FROM jobs WHERE idempotency_key=%s", (key,))
        return rows[0]["job_id"] if rows else None

    async def load_job(self, job_id: str) -> Job | None:
        rows = await self.db.read(f"{JOB_WITH_TRACKS} WHERE j.job_id=%s", (job_id,))
        return job_from_row(rows[0], rows[0]["tracks"]) if rows else None

    async def active_jobs(self) -> list[Job]:
        rows = await self.db.read(f"{JOB_WITH_TRACKS} WHERE NOT j.terminal ORDER BY j.seq")
        return [job_from_row(r, r["tracks"]) for r in rows]

    async def running_on(self, worker_id: int) -> list[Key]:
        rows = await self.db.read(
            "SELECT job_id, idx FROM tracks WHERE worker_id=%s AND status = ANY(%s)", (worker_id, RUNNING_VALUES)
        )
        return [(r["job_id"], int(r["idx"])) for r in rows]

    async def expired_jobs(self, older_than: float) -> list[str]:
        rows = await self.db.read(
            "SELECT job_id FROM jobs WHERE terminal AND finished_at < %s ORDER BY finished_at", (older_than,)
        )
        return [r["job_id"] for r in rows]

    async def finished_jobs_oldest_first(self) -> list[str]:
        return [r["job_id"] for r in await self.db.read("SELECT job_id FROM jobs WHERE terminal ORDER BY finished_at")]

    async def job_ids(self) -> set[str]:
        return {r["job_id"] for r in await self.db.read("SELECT job_id FROM jobs")}

    async def jobs_newest_first(self, caller: str | None, below: int | None, limit: int) -> list[tuple[str, int]]:
        rows = await self.db.read(
            "SELECT job_id, seq FROM jobs WHERE (%s::bigint IS NULL OR seq < %s) AND (%s::text IS NULL OR caller = %s)"
            " ORDER BY seq DESC LIMIT %s",
            (below, below, caller, caller, limit),
        )
        return [(r["job_id"], int(r["seq"])) for r in rows]

    async def delete_job(self, job_id: str) -> None:
        await self._job_write("DELETE FROM jobs WHERE job_id=%s", (job_id,))

    async def counts(self) -> dict[str, int]:
        rows = await self.db.read("SELECT status, COUNT(*) AS n FROM tracks GROUP BY status")
        return {r["status"]: int(r["n"]) for r in rows}

    async def finished_work_ratios(self, limit: int = 200) -> list[tuple[str, float]]:
        rows = await self.db.read(
            "SELECT metadata, started_at, finished_at, duration_sec FROM tracks WHERE status='done'"
            " AND duration_sec > 0 ORDER BY finished_at DESC LIMIT %s",
            (limit,),
        )
        return work_ratios((r["metadata"], r["started_at"], r["finished_at"], r["duration_sec"]) for r in rows)

    async def usage(self, caller: str | None, since: float) -> Usage:
        return usage_from_row((await self.db.read(USAGE, (caller, caller, since)))[0])

    # ---- events and one-at-a-time work ---------------------------------------------------------
    @asynccontextmanager
    async def listen(self, on_change: Callable[[str], None]) -> AsyncIterator[None]:
        task = asyncio.create_task(self._listen(on_change), name="store-listen")
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _listen(self, on_change: Callable[[str], None]) -> None:
        backoff = 0.2
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(
                    self.url, autocommit=True, options=self.limits.options(self.url)
                ) as conn:
                    await conn.execute(f"LISTEN {CHANNEL}")
                    on_change("*")  # anything missed while not listening: resync everything
                    backoff = 0.2
                    async for note in conn.notifies():
                        origin, _, job_id = note.payload.partition("|")
                        if origin != self.origin:
                            on_change(job_id)
            except psycopg.Error as exc:
                log.warning("store events: connection lost (%s); listening again in %.1fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(5.0, backoff * 2)

    @asynccontextmanager
    async def exclusive(self, name: str) -> AsyncIterator[bool]:
        key = zlib.crc32(name.encode())
        async with self.db.connection() as conn:
            row = await (await conn.execute("SELECT pg_try_advisory_lock(%s) AS got", (key,))).fetchone()
            got = bool(row and row["got"])
            try:
                yield got
            finally:
                if got:
                    await conn.execute("SELECT pg_advisory_unlock(%s)", (key,))

    async def probe(self, timeout: float) -> None:
        """The lock every write takes on the job tables (``ROW EXCLUSIVE``: it waits only for a lock
        that would stall writes), asked for under ``timeout`` and let go at once, on the loops' pool."""
        ms = max(1, round(timeout * 1000))
        async with self.db.loops.tx(wait=timeout, limits=StoreLimits(2 * timeout, timeout)) as conn:
            await conn.execute(
                f"SET LOCAL lock_timeout = {ms}; SET LOCAL statement_timeout = {2 * ms};"
                " LOCK TABLE jobs, tracks IN ROW EXCLUSIVE MODE"
            )
