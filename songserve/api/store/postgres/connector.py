"""The PostgreSQL connector: the store's narrow interface over psycopg 3's pools (``conn.py``).

What only this engine has lives here, behind the connector's calls:
- ``notify``: ``NOTIFY songserve_jobs, '<origin>|<job_id>'`` in the writing transaction (delivered on
  commit); ``listen`` keeps one connection of its own on ``LISTEN`` and reconnects with a back-off,
  asking for a full resync (``*``) after any gap; a dispatcher does not hear its own changes;
- ``lock``: a transaction-level advisory lock (a key's quota, the schema, worker registrations);
- ``exclusive``: a session advisory lock, so one dispatcher at a time sweeps retention;
- ``probe``: the lock every write takes on the job tables, asked for under a short lock timeout and
  let go at once, on the background loops' pool: a table locked by anyone turns ``/ready`` red;
- the dialect: the database's clock (leases and presence need no agreement between hosts' clocks),
  ``GREATEST``, ``FOR UPDATE SKIP LOCKED`` and ``FOR SHARE`` row locks, ``%s`` placeholders.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

import psycopg

from songserve.api.store.connector import Dialect, Params, Row
from songserve.api.store.postgres.conn import NOW, Conn, PgConnections, PgLanes, StoreLimits

log = logging.getLogger(__name__)
CHANNEL = "songserve_jobs"
POSTGRESQL = Dialect(
    name="postgresql",
    now=NOW,
    greatest="GREATEST",
    skip_locked=" FOR UPDATE SKIP LOCKED",
    for_share=" FOR SHARE",
    placeholder="%s",
)


class PgTx:
    """One transaction on one pooled (or plain) connection."""

    def __init__(self, conn: Conn, origin: str) -> None:
        self.conn = conn
        self.origin = origin

    async def execute(self, sql: str, params: Params = ()) -> int:
        return (await self.conn.execute(POSTGRESQL.render(sql), params)).rowcount

    async def execute_many(self, sql: str, rows: Sequence[Params]) -> None:
        if rows:
            async with self.conn.cursor() as cur:
                await cur.executemany(POSTGRESQL.render(sql), rows)

    async def fetch_one(self, sql: str, params: Params = ()) -> Row | None:
        return await (await self.conn.execute(POSTGRESQL.render(sql), params)).fetchone()

    async def fetch_all(self, sql: str, params: Params = ()) -> list[Row]:
        return await (await self.conn.execute(POSTGRESQL.render(sql), params)).fetchall()

    async def notify(self, job_id: str) -> None:
        await self.conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, f"{self.origin}|{job_id}"))

    async def lock(self, key: int, name: str | None = None) -> None:
        if name is None:
            await self.conn.execute("SELECT pg_advisory_xact_lock(%s)", (key,))
        else:
            await self.conn.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (key, name))


class PgConnector:
    """``Connector`` over the store's two pools (``PgLanes``: the calling lane's is used)."""

    dialect = POSTGRESQL

    def __init__(self, url: str, origin: str, pool_size: int, limits: StoreLimits) -> None:
        self.url = url
        self.origin = origin  # this dispatcher's id: its own NOTIFYs are not news to it
        self.limits = limits
        self.lanes = PgLanes(url, pool_size, limits)

    @property
    def routes(self) -> PgConnections:
        """The routes' pool (tests read its size)."""
        return self.lanes.routes

    async def open(self, timeout: float) -> None:
        await self.lanes.open(timeout)

    async def close(self) -> None:
        await self.lanes.close()

    async def fetch_one(self, sql: str, params: Params = ()) -> Row | None:
        rows = await self.lanes.read(POSTGRESQL.render(sql), params)
        return rows[0] if rows else None

    async def fetch_all(self, sql: str, params: Params = ()) -> list[Row]:
        return await self.lanes.read(POSTGRESQL.render(sql), params)

    async def read_together(self, statements: Sequence[tuple[str, Params]]) -> list[list[Row]]:
        return await self.lanes.read_together([(POSTGRESQL.render(sql), params) for sql, params in statements])

    async def execute(self, sql: str, params: Params = ()) -> int:
        return await self.lanes.count(POSTGRESQL.render(sql), params)

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[PgTx]:
        async with self.lanes.tx() as conn:
            yield PgTx(conn, self.origin)

    # ---- what only PostgreSQL has ------------------------------------------------------------------
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
        async with self.lanes.connection() as conn:
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
        async with self.lanes.loops.tx(wait=timeout, limits=StoreLimits(2 * timeout, timeout)) as conn:
            await conn.execute(
                f"SET LOCAL lock_timeout = {ms}; SET LOCAL statement_timeout = {2 * ms};"
                " LOCK TABLE jobs, tracks IN ROW EXCLUSIVE MODE"
            )


class PgSession:
    """One plain connection, for the migrations at open (before the pools): the runner's transactions."""

    dialect = POSTGRESQL

    def __init__(self, conn: Conn, origin: str) -> None:
        self.conn = conn
        self.origin = origin

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[PgTx]:
        async with self.conn.transaction():
            yield PgTx(self.conn, self.origin)
