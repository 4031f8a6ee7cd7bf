"""The PostgreSQL engine of the job store: several dispatchers, one queue (``STORE_URL=postgresql://…``).

Through psycopg 3 with an async connection pool; every method is one short transaction.
- Claims: ``claim`` locks the queued rows it wants with ``FOR UPDATE SKIP LOCKED`` in the order the
  dispatcher asks (its queue order), so two dispatchers never claim one track and neither waits on
  the other; rows another dispatcher holds or already took are skipped.
- Compare-and-set writes: a track row is written only while its (status, owner) are what the writer
  last saw (``StaleTrack`` otherwise).
- Leases and presence are timed on the database's clock, so hosts' clocks need not agree.
- Events: every write to a job sends ``NOTIFY songserve_jobs, '<origin>|<job_id>'`` in its
  transaction (delivered on commit); ``listen`` keeps one connection of its own on ``LISTEN`` and
  reconnects with a back-off, asking for a full resync (``*``) after any gap.
- ``exclusive`` is a session advisory lock: one dispatcher at a time sweeps retention.
- The pooled connections and what a dead one means (a database restart): ``store_pg_conn.py``.
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

from songserve.api.migrations_pg import migrate
from songserve.api.migrations_sqlite import NewerSchemaError
from songserve.api.states import RUNNING, TERMINAL, TrackStatus
from songserve.api.store import (
    STORED_TRACK_FIELDS,
    DuplicateKey,
    Job,
    Key,
    StaleTrack,
    Track,
    WorkerRow,
    job_from_row,
    stored_value,
    work_ratios,
)
from songserve.api.store_pg_conn import PgConnections, redact
from songserve.errors import ConfigError

log = logging.getLogger(__name__)
CHANNEL = "songserve_jobs"
NOW = "extract(epoch from clock_timestamp())"  # the database's clock, in epoch seconds
TERMINAL_VALUES = [s.value for s in TERMINAL]
TRACK_COLUMN_TYPES = {
    "status": "text", "seed": "bigint", "attempts": "int", "worker_id": "int", "task_id": "text", "owner": "text",
    "error": "text", "duration_sec": "float8", "started_at": "float8", "finished_at": "float8", "metadata": "text",
    "worker_phase": "text", "phase_progress": "int", "phase_detail": "text", "phase_rate": "float8",
}  # fmt: skip
# A job row with its tracks as one JSON array: one round trip for a whole job.
JOB_WITH_TRACKS = (
    "SELECT j.*, COALESCE((SELECT json_agg(t ORDER BY t.idx) FROM tracks t WHERE t.job_id = j.job_id), '[]')"
    " AS tracks FROM jobs j"
)
RUNNING_VALUES = [s.value for s in RUNNING]


class PgStore:
    shared = True

    def __init__(self, url: str, origin: str, pool_size: int = 10) -> None:
        self.url = url
        self.where = redact(url)
        self.origin = origin  # this dispatcher's id: its own NOTIFYs are not news to it
        self.db = PgConnections(url, pool_size)

    @classmethod
    async def open(cls, url: str, origin: str, pool_size: int = 10, timeout: float = 10.0) -> PgStore:
        """Connect and migrate; a store that cannot be used raises ``ConfigError`` in one line."""
        store = cls(url, origin, pool_size)
        try:
            # One plain connection first: a wrong URL fails once, in one line, not in the pool's retries.
            async with await psycopg.AsyncConnection.connect(
                url, autocommit=True, row_factory=dict_row, connect_timeout=max(1, int(timeout))
            ) as conn:
                await migrate(conn)
            await store.db.open(timeout)
        except NewerSchemaError as exc:
            await store.db.close()
            raise ConfigError(
                f"The job store {store.where} has schema version {exc.found}, newer than this build's {exc.known}: "
                "run the newer songserve on it, or point STORE_URL at another database."
            ) from None
        except (psycopg.Error, PoolTimeout) as exc:
            await store.db.close()
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"The job store {store.where} cannot be opened ({first}).") from None
        return store

    async def close(self) -> None:
        await self.db.close()

    def _announcing(self, write: str) -> str:
        """``write`` (an UPDATE/DELETE … RETURNING job_id) and its NOTIFY as one statement."""
        return f"WITH w AS ({write}) SELECT w.job_id, pg_notify('{CHANNEL}', %s || '|' || w.job_id) FROM w"

    # ---- jobs and tracks -----------------------------------------------------------------------
    async def insert_job(self, job: Job) -> None:
        try:
            rows = await self.db.rows(
                "WITH j AS (INSERT INTO jobs (job_id, created_at, priority, request, cleaned_lyrics, num_tracks,"
                " idempotency_key) VALUES (%s, %s, %s, %s, %s, %s, %s) RETURNING job_id, seq),"
                " t AS (INSERT INTO tracks (job_id, idx, status, seed)"
                " SELECT j.job_id, x.idx, x.status, x.seed FROM j, unnest(%s::int[], %s::text[], %s::bigint[])"
                " AS x(idx, status, seed))"
                f" SELECT j.seq, pg_notify('{CHANNEL}', %s || '|' || j.job_id) FROM j",
                (job.job_id, job.created_at, job.priority, job.request.model_dump_json(), job.cleaned_lyrics,
                 len(job.tracks), job.idempotency_key, [t.index for t in job.tracks],
                 [t.status.value for t in job.tracks], [t.seed for t in job.tracks], self.origin),
            )  # fmt: skip
        except pg_errors.UniqueViolation:
            found = await self.job_by_key(job.idempotency_key or "")
            if found is None:
                raise
            raise DuplicateKey(found) from None
        job.seq = int(rows[0]["seq"])

    async def claim(self, tracks: list[Track]) -> set[int]:
        """One statement: lock the wanted rows still queued (``SKIP LOCKED``, in the given order), write
        each one's new state, and NOTIFY, all in one round trip."""
        if not tracks:
            return set()
        columns = ", ".join(STORED_TRACK_FIELDS)
        arrays = ", ".join(f"%s::{TRACK_COLUMN_TYPES[f]}[]" for f in STORED_TRACK_FIELDS)
        sets = ", ".join(f"{f}=w.{f}" for f in STORED_TRACK_FIELDS)
        rows = await self.db.rows(
            f"WITH w AS (SELECT * FROM unnest(%s::int[], {arrays}) WITH ORDINALITY AS w(idx, {columns}, ord)),"
            " locked AS (SELECT t.idx FROM tracks t JOIN w ON t.idx = w.idx WHERE t.job_id=%s AND t.status='queued'"
            " ORDER BY w.ord FOR UPDATE OF t SKIP LOCKED),"
            f" claimed AS (UPDATE tracks t SET {sets} FROM w WHERE t.job_id=%s AND t.idx = w.idx"
            " AND t.idx IN (SELECT idx FROM locked) RETURNING t.idx),"
            f" n AS (SELECT pg_notify('{CHANNEL}', %s || '|' || %s) WHERE EXISTS (SELECT 1 FROM claimed))"
            " SELECT idx FROM claimed, (SELECT count(*) FROM n) AS sent",
            [
                [t.index for t in tracks],
                *([stored_value(t, f) for t in tracks] for f in STORED_TRACK_FIELDS),
                tracks[0].job_id,
                tracks[0].job_id,
                self.origin,
                tracks[0].job_id,
            ],
        )
        return {int(r["idx"]) for r in rows}

    async def save_track(self, t: Track, seen: tuple[TrackStatus, str | None]) -> None:
        sets = ", ".join(f"{f}=%s" for f in STORED_TRACK_FIELDS)
        rows = await self.db.rows(
            self._announcing(
                f"UPDATE tracks SET {sets} WHERE job_id=%s AND idx=%s AND status=%s"
                " AND owner IS NOT DISTINCT FROM %s RETURNING job_id"
            ),
            [
                *(stored_value(t, f) for f in STORED_TRACK_FIELDS),
                t.job_id,
                t.index,
                seen[0].value,
                seen[1],
                self.origin,
            ],
        )
        if not rows:
            raise StaleTrack(t.key)

    async def save_progress(self, t: Track) -> None:
        await self.db.rows(
            self._announcing(
                "UPDATE tracks SET worker_phase=%s, phase_progress=%s, phase_detail=%s, phase_rate=%s"
                " WHERE job_id=%s AND idx=%s AND owner IS NOT DISTINCT FROM %s RETURNING job_id"
            ),
            (t.worker_phase, t.phase_progress, t.phase_detail, t.phase_rate, t.job_id, t.index, t.owner, self.origin),
        )

    async def _job_write(self, sql: str, params: tuple[Any, ...]) -> None:
        await self.db.rows(self._announcing(sql + " RETURNING job_id"), (*params, self.origin))

    async def mark_started(self, job_id: str, at: float) -> None:
        await self._job_write("UPDATE jobs SET started_at=COALESCE(started_at, %s) WHERE job_id=%s", (at, job_id))

    async def mark_cancelled(self, job_id: str) -> None:
        await self._job_write("UPDATE jobs SET cancelled=true WHERE job_id=%s", (job_id,))

    async def finish_job(self, job_id: str, at: float) -> bool:
        rows = await self.db.rows(
            "WITH u AS (UPDATE jobs SET terminal=true, finished_at=COALESCE(finished_at, %s) WHERE job_id=%s"
            " AND NOT terminal AND NOT EXISTS (SELECT 1 FROM tracks WHERE job_id=%s AND status <> ALL(%s))"
            f" RETURNING job_id), n AS (SELECT pg_notify('{CHANNEL}', %s || '|' || job_id) FROM u)"
            " SELECT (SELECT count(*) FROM n) > 0 OR COALESCE((SELECT terminal FROM jobs WHERE job_id=%s), false)"
            " AS terminal",
            (at, job_id, job_id, TERMINAL_VALUES, self.origin, job_id),
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

    # ---- workers, dispatchers and leases -------------------------------------------------------
    async def register_worker(self, url: str, ttl: float, announced: bool) -> int:
        renew = (
            f"UPDATE workers SET registered_until=GREATEST(registered_until, {NOW} + %s), announced=%s"
            " WHERE url=%s RETURNING worker_id"
        )
        async with self.db.tx() as conn:
            row = await (await conn.execute(renew, (ttl, announced, url))).fetchone()  # the usual case: a renewal
            if row is None:  # a new URL: ids are handed out one registration at a time
                await conn.execute("LOCK TABLE workers IN SHARE ROW EXCLUSIVE MODE")
                row = await (await conn.execute(renew, (ttl, announced, url))).fetchone()
            if row is None:
                cur = await conn.execute(
                    "INSERT INTO workers (worker_id, url, announced, registered_until)"
                    f" SELECT COALESCE(MAX(worker_id) + 1, 0), %s, %s, {NOW} + %s FROM workers RETURNING worker_id",
                    (url, announced, ttl),
                )
                row = await cur.fetchone()
        return int(row["worker_id"])  # type: ignore[index]

    async def withdraw_worker(self, worker_id: int) -> bool:
        rows = await self.db.rows(
            "UPDATE workers SET registered_until=0 WHERE worker_id=%s AND registered_until > 0 RETURNING worker_id",
            (worker_id,),
        )
        return bool(rows)

    async def live_workers(self) -> list[WorkerRow]:
        rows = await self.db.read(
            f"SELECT worker_id, url, announced, CASE WHEN lease_until > {NOW} THEN lease_owner END AS owner"
            f" FROM workers WHERE registered_until > {NOW} ORDER BY worker_id"
        )
        return [WorkerRow(int(r["worker_id"]), r["url"], bool(r["announced"]), r["owner"]) for r in rows]

    async def heartbeat(self, dispatcher_id: str, ttl: float) -> set[str]:
        async with self.db.tx() as conn:
            await conn.execute(
                f"INSERT INTO dispatchers VALUES (%s, {NOW} + %s)"
                " ON CONFLICT (dispatcher_id) DO UPDATE SET alive_until=EXCLUDED.alive_until",
                (dispatcher_id, ttl),
            )
            await conn.execute(f"DELETE FROM dispatchers WHERE alive_until < {NOW} - 3600")
            cur = await conn.execute(f"SELECT dispatcher_id FROM dispatchers WHERE alive_until > {NOW}")
            return {r["dispatcher_id"] for r in await cur.fetchall()}

    async def leave(self, dispatcher_id: str) -> None:
        async with self.db.tx() as conn:
            await conn.execute("DELETE FROM dispatchers WHERE dispatcher_id=%s", (dispatcher_id,))
            await conn.execute(
                "UPDATE workers SET lease_owner=NULL, lease_until=0 WHERE lease_owner=%s", (dispatcher_id,)
            )

    async def renew_leases(self, owner: str, ttl: float) -> set[int]:
        rows = await self.db.rows(
            f"UPDATE workers SET lease_until={NOW} + %s WHERE lease_owner=%s AND lease_until > {NOW} RETURNING worker_id",
            (ttl, owner),
        )
        return {int(r["worker_id"]) for r in rows}

    async def acquire_lease(self, owner: str, worker_id: int, ttl: float) -> bool:
        rows = await self.db.rows(
            f"UPDATE workers SET lease_owner=%s, lease_until={NOW} + %s WHERE worker_id=%s AND registered_until > {NOW}"
            f" AND (lease_owner IS NULL OR lease_owner=%s OR lease_until <= {NOW}) RETURNING worker_id",
            (owner, ttl, worker_id, owner),
        )
        return bool(rows)

    async def release_lease(self, owner: str, worker_id: int) -> None:
        await self.db.rows(
            "UPDATE workers SET lease_owner=NULL, lease_until=0 WHERE worker_id=%s AND lease_owner=%s RETURNING worker_id",
            (worker_id, owner),
        )

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
                async with await psycopg.AsyncConnection.connect(self.url, autocommit=True) as conn:
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
