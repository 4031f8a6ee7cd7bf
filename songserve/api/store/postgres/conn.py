"""The PostgreSQL store's connections: psycopg 3's async pool, one call per statement or transaction,
and what a dead connection means.

Kept apart from the connector (``connector.py``, the store's narrow interface), which calls only
``rows`` and ``count`` (one statement), ``read`` and ``read_together`` (reads, retried once) and ``tx``
(one transaction):
- two pools, one for the routes and one for the background loops and attempts (``BACKGROUND``
  picks, per call), so routes stalled on a locked table cannot take every connection the loops need;
- a single statement runs in autocommit, which is one implicit transaction and saves the
  BEGIN/COMMIT round trips;
- a database failure becomes ``StoreError`` (503 with Retry-After); a call waits at most
  ``CONNECTION_WAIT_SEC`` for a pooled connection, so while the database is down clients hear so in
  seconds;
- a database restart kills every pooled connection. The first call that meets a dead one has the
  pool test and replace all of them (``recheck``), and a read that met one runs once more on a
  fresh connection; a write answers 503 for its client to retry, since whether a statement whose
  connection died was applied cannot be known;
- no wait on the database is unbounded: every connection starts with ``statement_timeout`` and
  ``lock_timeout`` (``STORE_STATEMENT_TIMEOUT_SEC``, ``STORE_LOCK_TIMEOUT_SEC``), so a locked table
  or a stuck server costs a call seconds and a 503, never a request hung for as long as the lock
  lasts; a statement cut short is rolled back by the server, so a write either happened whole or not;
- no transaction holds its locks for as long as its dispatcher is away: a dispatcher stopped between
  two statements of a transaction (paused, a frozen VM, a long collection) would keep its row locks
  until it resumed, and every other dispatcher's take-over of its workers would wait on them. The
  server ends a session idle in a transaction after the statement timeout
  (``idle_in_transaction_session_timeout``), rolling it back; the paused dispatcher meets a dead
  connection when it resumes, as after a restart.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool, PoolClosed, PoolTimeout

from songserve.api.store.connector import Conflict
from songserve.api.store.protocol import BACKGROUND, DuplicateKey, StaleTrack, StoreError

log = logging.getLogger(__name__)
# How long a call waits for a pooled connection before it answers 503: short, so that while the
# database is down (no connection to be had) clients hear so in seconds, not after psycopg's 30 s.
CONNECTION_WAIT_SEC = 5.0
NOW = "extract(epoch from clock_timestamp())"  # the database's clock, in epoch seconds
Conn = psycopg.AsyncConnection[dict[str, Any]]


@dataclass(frozen=True)
class StoreLimits:
    """How long one statement may run, and wait for a lock, on the store's connections (seconds)."""

    statement_timeout_sec: float = 5.0
    lock_timeout_sec: float = 2.0

    def options(self, url: str) -> str:
        """libpq ``options`` for a connection to ``url``: the URL's own, then these two settings (the
        statement timeout also bounds a transaction left idle)."""
        try:
            own = str(psycopg.conninfo.conninfo_to_dict(url).get("options") or "")
        except psycopg.ProgrammingError:
            own = ""
        ms = (max(1, round(self.statement_timeout_sec * 1000)), max(1, round(self.lock_timeout_sec * 1000)))
        limits = f"-c statement_timeout={ms[0]} -c lock_timeout={ms[1]} -c idle_in_transaction_session_timeout={ms[0]}"
        return f"{own} {limits}".strip()

    def reason(self, exc: psycopg.Error) -> str | None:
        """What a cut-short statement means, naming the server setting (STORE_LOCK_TIMEOUT_SEC and
        STORE_STATEMENT_TIMEOUT_SEC set them); None for any other error."""
        if isinstance(exc, psycopg.errors.LockNotAvailable):
            return f"a table it needs stayed locked past {self.lock_timeout_sec:g}s (lock_timeout)"
        if isinstance(exc, psycopg.errors.QueryCanceled):
            return f"a statement ran past {self.statement_timeout_sec:g}s (statement_timeout)"
        return None


class ConnectionLost(StoreError):
    """The pooled connection was dead (the server restarted or dropped it)."""


def redact(url: str) -> str:
    """The connection string without its password (for logs and /status)."""
    try:
        parts = psycopg.conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return "postgresql://(unreadable URL)"
    host, port, db = parts.get("host", "localhost"), parts.get("port", "5432"), parts.get("dbname", "")
    user = f"{parts['user']}@" if parts.get("user") else ""
    return f"postgresql://{user}{host}:{port}/{db}"


class PgConnections:
    """The pool of one store, opened by ``open`` and closed by ``close``."""

    def __init__(self, url: str, pool_size: int, limits: StoreLimits, name: str = "songserve-store") -> None:
        self.limits = limits
        self.pool = AsyncConnectionPool(
            url,
            min_size=1,
            max_size=pool_size,
            open=False,
            kwargs={"autocommit": True, "row_factory": dict_row, "options": limits.options(url)},
            name=name,
            timeout=CONNECTION_WAIT_SEC,
        )
        self._checking: asyncio.Task[None] | None = None

    async def open(self, timeout: float) -> None:
        await self.pool.open(wait=True, timeout=timeout)

    async def close(self) -> None:
        await self.pool.close()

    def connection(self) -> AbstractAsyncContextManager[Conn]:
        """A pooled connection as it is (a session advisory lock needs the same one throughout)."""
        return self.pool.connection()  # type: ignore[return-value]  # the pool's connections make dict rows

    @asynccontextmanager
    async def tx(
        self, transaction: bool = True, wait: float | None = None, limits: StoreLimits | None = None
    ) -> AsyncIterator[Conn]:
        """A pooled connection (waiting at most ``wait`` seconds for one), in one transaction (or
        autocommit for a single statement, which is one implicit transaction and saves the BEGIN/COMMIT
        round trips); a database failure becomes ``StoreError`` (``limits``: those the caller set for
        this transaction, for the message)."""
        used: Conn | None = None
        try:
            async with self.pool.connection(timeout=wait) as conn:
                used = conn  # type: ignore[assignment]  # the pool's connections make dict rows
                if not transaction:
                    yield conn  # type: ignore[misc]
                    return
                async with conn.transaction():
                    yield conn  # type: ignore[misc]
        except (DuplicateKey, StaleTrack):
            raise
        except psycopg.errors.UniqueViolation as exc:
            raise Conflict(str(exc).strip().splitlines()[0] if str(exc).strip() else "unique violation") from exc
        except (psycopg.OperationalError, psycopg.InterfaceError, psycopg.errors.DiskFull) as exc:
            if (why := (limits or self.limits).reason(exc)) is not None:
                raise StoreError(why) from exc
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if used is not None and used.broken:
                self.recheck()
                raise ConnectionLost(first) from exc
            raise StoreError(first) from exc
        except PoolTimeout as exc:
            raise StoreError(f"no database connection ({exc})") from exc

    def recheck(self) -> asyncio.Task[None]:
        """Test every idle pooled connection and replace the dead ones (once at a time)."""
        if self._checking is None or self._checking.done():
            log.warning("job store: a pooled connection was dead; testing the others")
            self._checking = asyncio.get_running_loop().create_task(self.pool.check())
        return self._checking

    async def rows(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        """One statement (a write with its NOTIFY in the same statement): one round trip."""
        async with self.tx(transaction=False) as conn:
            cur = await conn.execute(sql, params)
            return await cur.fetchall()

    async def count(self, sql: str, params: Sequence[Any] = ()) -> int:
        """One write statement in autocommit; the rows it changed."""
        async with self.tx(transaction=False) as conn:
            return (await conn.execute(sql, params)).rowcount

    async def _together(self, statements: Sequence[tuple[str, Sequence[Any]]]) -> list[list[dict[str, Any]]]:
        """The reads in one read-only snapshot, sent as one pipeline: one round trip, not one per statement."""
        async with self.tx(transaction=False) as conn:
            async with conn.pipeline():
                await conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                cursors = [await conn.execute(sql, params) for sql, params in statements]
                await conn.execute("COMMIT")
            return [await cur.fetchall() for cur in cursors]

    async def read(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        """One read; on a dead connection, once more after the pool has replaced its dead ones."""
        return (await self.read_together([(sql, params)]))[0]

    async def read_together(self, statements: Sequence[tuple[str, Sequence[Any]]]) -> list[list[dict[str, Any]]]:
        """Reads seen at one moment (one statement alone, or a read-only snapshot); on a dead
        connection, once more after the pool has replaced its dead ones."""

        async def once() -> list[list[dict[str, Any]]]:
            if len(statements) == 1:
                return [await self.rows(*statements[0])]
            return await self._together(statements)

        try:
            return await once()
        except ConnectionLost as lost:
            try:
                await asyncio.shield(self.recheck())
            except (psycopg.Error, PoolClosed) as exc:  # the pool is closing, or cannot test its connections
                raise StoreError(f"no database connection ({exc})") from lost
            return await once()


class PgLanes:
    """The store's two pools: the routes' and the background loops' (``BACKGROUND`` picks per call).

    Its ``rows``, ``count``, ``read``, ``read_together``, ``tx`` and ``connection`` are the calling lane's,
    so the connector holds this one object and never picks a pool itself."""

    def __init__(self, url: str, pool_size: int, limits: StoreLimits) -> None:
        self.routes = PgConnections(url, pool_size, limits, "songserve-routes")
        self.loops = PgConnections(url, pool_size, limits, "songserve-loops")

    @property
    def lane(self) -> PgConnections:
        """The calling lane's pool: the background loops' own, or the routes'."""
        return self.loops if BACKGROUND.get() else self.routes

    async def open(self, timeout: float) -> None:
        await self.routes.open(timeout)
        await self.loops.open(timeout)

    async def close(self) -> None:
        await self.routes.close()
        await self.loops.close()

    def connection(self) -> AbstractAsyncContextManager[Conn]:
        return self.lane.connection()

    def tx(self) -> AbstractAsyncContextManager[Conn]:
        return self.lane.tx()

    async def rows(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        return await self.lane.rows(sql, params)

    async def count(self, sql: str, params: Sequence[Any] = ()) -> int:
        return await self.lane.count(sql, params)

    async def read(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        return await self.lane.read(sql, params)

    async def read_together(self, statements: Sequence[tuple[str, Sequence[Any]]]) -> list[list[dict[str, Any]]]:
        return await self.lane.read_together(statements)
