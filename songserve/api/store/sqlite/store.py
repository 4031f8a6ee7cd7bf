"""The SQLite engine of the job store: jobs and tracks in one file (WAL) under the state folder.

Everything a restart needs is here: the request, each track's status, attempts, worker, task id,
timings and metadata. The dispatcher's queue is rebuilt from it at start-up. ``SqliteStore`` is the
store written once (``store/jobs.py``) over the SQLite connector (``connector.py``: one connection on
a thread of its own, so the event loop never waits on the disk or a busy lock); opening it migrates
the file forward (the steps: ``migrations.py``; the runner: ``store/migrations.py``).

The file is checked before the service opens it (``store/sqlite/check.py``: damage, an empty file
beside results, a newer schema).
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from songserve.api.store.jobs import Store
from songserve.api.store.migrations import NewerSchemaError, migrate
from songserve.api.store.protocol import StoreError
from songserve.api.store.sqlite.connector import SqliteConnector
from songserve.api.store.sqlite.migrations import MIGRATIONS
from songserve.errors import ConfigError

T = TypeVar("T")


class SqliteStore(Store):
    """The SQLite engine of ``JobStore``: one file, one dispatcher. Open it after ``prepare_store``
    (``store/sqlite/check.py``). Opening blocks (start-up work: the file is opened and migrated);
    events stay in the process (no other dispatcher can share the file), and ``exclusive`` always holds.
    """

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        try:
            db = SqliteConnector(path)
        except sqlite3.DatabaseError as exc:
            raise ConfigError(f"The job store {path} cannot be opened ({exc}).") from None
        super().__init__(db, str(path), shared=False)
        self.db: SqliteConnector = db
        try:
            _blocking(self._open)
        except NewerSchemaError as exc:
            db.shutdown()
            raise ConfigError(newer_schema_message(path, exc)) from None
        except StoreError as exc:
            db.shutdown()
            raise ConfigError(f"The job store {path} cannot be opened ({exc.args[0]}).") from None

    async def _open(self) -> None:
        await migrate(self.db, MIGRATIONS)
        await self.read_ident()


def _blocking(step: Callable[[], Awaitable[T]]) -> T:
    """Run an async start-up step to its end from synchronous code, on an event loop of its own (so
    that a caller already on a running loop may open a store, as the tests and the app do)."""

    async def run() -> T:
        return await step()

    with ThreadPoolExecutor(1, thread_name_prefix="sqlite-open") as once:
        return once.submit(asyncio.run, run()).result()


def newer_schema_message(path: Path, exc: NewerSchemaError) -> str:
    """The one line that refuses a store written by a newer build."""
    return exc.refusal(str(path), "STATE_DIR at another folder")
