"""The SQLite connector: one connection, owned by one thread of its own, every call awaited through it.

Why a thread: a statement may wait on the disk, or up to ``BUSY_TIMEOUT_MS`` for a write lock another
process holds; on the event loop that wait would stall every request (``/health`` included). So the
connection is opened, used and closed on one thread (``sqlite-store``) and the loop only awaits the
answers. An ``asyncio.Lock`` keeps one caller at a time on the connection, so a transaction's statements
are never interleaved with another caller's, though the transaction awaits between them. The lock has
two lanes: the background loops' and the attempts' calls (``BACKGROUND``: lease renewals, the store's
probe, a track's writes) go before the routes' calls waiting for it, so a burst of a thousand submissions
queued on the connection cannot hold a lease renewal past ``LEASE_TTL_SEC`` or turn ``/ready`` red while
the store answers. PostgreSQL gets the same from a pool of their own.

Transactions are ``BEGIN IMMEDIATE`` (SQLite's write lock, which also serialises the quota check with
the insert it admits); a single statement runs in autocommit. A SQLite failure becomes ``StoreError``,
a unique constraint ``Conflict``. There is one dispatcher per file, so ``notify``, ``lock``, ``listen``
and ``exclusive`` have nothing to do.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any, TypeVar

from songserve.api.store.connector import Conflict, Dialect, Params, Row
from songserve.api.store.protocol import BACKGROUND, StoreError

BUSY_TIMEOUT_MS = 5000  # how long a statement waits for another process's write lock (sqlite3's default)
SQLITE = Dialect(
    name="sqlite",
    now="((julianday('now') - 2440587.5) * 86400.0)",  # this host's clock, in epoch seconds (ms resolution)
    greatest="MAX",
    skip_locked="",  # the write lock is the store's: no row is ever held by another writer
    for_share="",
    placeholder="?",
)
T = TypeVar("T")


def _dict_row(cur: sqlite3.Cursor, row: tuple[Any, ...]) -> Row:
    return {d[0]: v for d, v in zip(cur.description, row, strict=True)}


def _connect(path: Path) -> sqlite3.Connection:
    db = sqlite3.connect(path, isolation_level=None, timeout=BUSY_TIMEOUT_MS / 1000)  # owned by its thread
    try:
        db.row_factory = _dict_row
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute("PRAGMA foreign_keys=ON")
    except BaseException:
        db.close()
        raise
    return db


@contextmanager
def _errors() -> Iterator[None]:
    """SQLite's failures as the store's: ``Conflict`` for a unique constraint, else ``StoreError``."""
    try:
        yield
    except sqlite3.IntegrityError as exc:
        raise Conflict(str(exc)) from exc
    except sqlite3.Error as exc:
        raise StoreError(str(exc)) from exc


class LaneLock:
    """A lock of one event loop with two lanes: a waiter in the first lane is served before any waiter
    in the second, each lane first come, first served. ``release`` hands the lock straight to the next
    waiter, so nobody arriving meanwhile can take it in between."""

    def __init__(self) -> None:
        self._held = False
        self._lanes: tuple[deque[asyncio.Future[None]], deque[asyncio.Future[None]]] = (deque(), deque())

    def locked(self) -> bool:
        return self._held

    async def acquire(self, first: bool) -> None:
        if not self._held and not (self._lanes[0] or self._lanes[1]):
            self._held = True
            return
        lane = self._lanes[0 if first else 1]
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        lane.append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.release()  # handed the lock as the wait was cancelled: pass it on
            elif turn in lane:
                lane.remove(turn)
            raise

    def release(self) -> None:
        if not self._held:
            raise RuntimeError("LaneLock released while not held")
        for lane in self._lanes:
            while lane:
                turn = lane.popleft()
                if not turn.done():
                    turn.set_result(None)  # the lock passes to this waiter, still held
                    return
        self._held = False

    @asynccontextmanager
    async def hold(self, first: bool) -> AsyncIterator[None]:
        await self.acquire(first)
        try:
            yield
        finally:
            self.release()


class SqliteTx:
    """A transaction on the connector's thread (the caller holds the connector's lock)."""

    def __init__(self, connector: SqliteConnector) -> None:
        self._c = connector

    async def execute(self, sql: str, params: Params = ()) -> int:
        return await self._c._call(lambda db: db.execute(SQLITE.render(sql), params).rowcount)

    async def execute_many(self, sql: str, rows: Sequence[Params]) -> None:
        if rows:
            await self._c._call(lambda db: db.executemany(SQLITE.render(sql), rows))

    async def fetch_one(self, sql: str, params: Params = ()) -> Row | None:
        return await self._c._call(lambda db: db.execute(SQLITE.render(sql), params).fetchone())

    async def fetch_all(self, sql: str, params: Params = ()) -> list[Row]:
        return await self._c._call(lambda db: db.execute(SQLITE.render(sql), params).fetchall())

    async def notify(self, job_id: str) -> None:
        return None  # one dispatcher per file: nobody else to tell

    async def lock(self, key: int, name: str | None = None) -> None:
        return None  # BEGIN IMMEDIATE holds the file's write lock already


class SqliteConnector:
    """``Connector`` over one SQLite file; opening it blocks (start-up work), every call after is awaited."""

    dialect = SQLITE

    def __init__(self, path: Path) -> None:
        self.path = path
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="sqlite-store")
        self._lock: LaneLock | None = None
        self._lock_loop: asyncio.AbstractEventLoop | None = None
        try:
            self._db = self._thread.submit(_connect, path).result()
        except BaseException:
            self._thread.shutdown(wait=False)
            raise

    # ---- the thread and the lock -----------------------------------------------------------------
    def _guard(self) -> LaneLock:
        """The lock of the running loop (a store opened before its loop, or used by two, gets one each)."""
        loop = asyncio.get_running_loop()
        if self._lock is None or self._lock_loop is not loop:
            self._lock, self._lock_loop = LaneLock(), loop
        return self._lock

    def _turn(self) -> AbstractAsyncContextManager[None]:
        """The connection for this caller, in its lane (``BACKGROUND`` first)."""
        return self._guard().hold(first=BACKGROUND.get())

    async def _call(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """``fn(connection)`` on the connector's thread; the caller holds the lock."""

        def run() -> T:
            with _errors():
                return fn(self._db)

        return await asyncio.get_running_loop().run_in_executor(self._thread, run)

    async def _alone(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        async with self._turn():
            return await self._call(fn)

    # ---- reads and writes ------------------------------------------------------------------------
    async def fetch_one(self, sql: str, params: Params = ()) -> Row | None:
        return await self._alone(lambda db: db.execute(SQLITE.render(sql), params).fetchone())

    async def fetch_all(self, sql: str, params: Params = ()) -> list[Row]:
        return await self._alone(lambda db: db.execute(SQLITE.render(sql), params).fetchall())

    async def read_together(self, statements: Sequence[tuple[str, Params]]) -> list[list[Row]]:
        def run(db: sqlite3.Connection) -> list[list[Row]]:
            db.execute("BEGIN")  # a read transaction: one snapshot for all of them
            try:
                return [db.execute(SQLITE.render(sql), params).fetchall() for sql, params in statements]
            finally:
                db.execute("COMMIT")

        return await self._alone(run)

    async def execute(self, sql: str, params: Params = ()) -> int:
        return await self._alone(lambda db: db.execute(SQLITE.render(sql), params).rowcount)

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[SqliteTx]:
        async with self._turn():
            await self._call(lambda db: db.execute("BEGIN IMMEDIATE"))
            try:
                yield SqliteTx(self)
            except BaseException:
                # Even when cancelled: the rollback queues behind the statement still running, on the
                # same thread, so the connection is never left inside a transaction.
                await asyncio.shield(self._call(_rollback))
                raise
            try:
                await self._call(lambda db: db.execute("COMMIT"))
            except StoreError:
                await asyncio.shield(self._call(_rollback))  # a commit refused (busy, disk full) keeps nothing
                raise

    # ---- what one dispatcher per file does not need ----------------------------------------------
    @asynccontextmanager
    async def listen(self, on_change: Callable[[str], None]) -> AsyncIterator[None]:
        yield  # one dispatcher per file: there is nobody else to hear from

    @asynccontextmanager
    async def exclusive(self, name: str) -> AsyncIterator[bool]:
        yield True

    async def probe(self, timeout: float) -> None:
        """Take the write lock and let it go at once, waiting at most ``timeout`` for it (a caller still
        on the connection, another process holding the file, a full disk)."""

        def run(db: sqlite3.Connection) -> None:
            db.execute(f"PRAGMA busy_timeout = {max(1, int(timeout * 1000))}")
            try:
                db.execute("BEGIN IMMEDIATE")
                db.execute("SELECT 1 FROM jobs LIMIT 1").fetchall()
                db.execute("ROLLBACK")
            except sqlite3.Error:
                _rollback(db)
                raise
            finally:
                db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")

        try:
            async with asyncio.timeout(timeout):
                await self._guard().acquire(first=BACKGROUND.get())
        except TimeoutError:
            raise StoreError(f"the store's connection stayed busy past {timeout:g}s") from None
        try:
            await self._call(run)
        finally:
            self._guard().release()

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.shutdown)

    def shutdown(self) -> None:
        """Close the connection on its thread and end the thread (blocking; also from outside a loop)."""
        try:
            self._thread.submit(self._db.close).result()
        except RuntimeError:
            return  # already shut down
        self._thread.shutdown(wait=True)


def _rollback(db: sqlite3.Connection) -> None:
    try:
        db.execute("ROLLBACK")
    except sqlite3.Error:
        pass  # SQLite may have rolled back already (disk full)
