"""The SQLite store's connection: how it is opened, and its one kind of write transaction.

Kept apart so the jobs store (``store/sqlite/store.py``) and its connectors (``outbox.py``,
``uploads.py``, ``members.py``) share one connection without inheriting from each other: each holds
the connection, reads on it directly (every call comes from the event-loop thread and is a short
local statement), and writes inside ``transaction``, where a SQLite failure becomes ``StoreError``.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from songserve.api.store.protocol import StoreError

BUSY_TIMEOUT_MS = 5000  # how long a statement waits for another process's write lock (sqlite3's default)


def connect(path: Path) -> sqlite3.Connection:
    """The store's connection to ``path``: autocommit (transactions are ``transaction``'s), rows by column name."""
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT_MS / 1000)
    db.row_factory = sqlite3.Row
    return db


def configure(db: sqlite3.Connection) -> None:
    """WAL, and foreign keys on; raises ``sqlite3.DatabaseError`` for a file that is not a store."""
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute("PRAGMA foreign_keys=ON")


@contextmanager
def transaction(db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """One write transaction (``BEGIN IMMEDIATE``); any SQLite failure becomes ``StoreError``."""
    try:
        db.execute("BEGIN IMMEDIATE")
    except sqlite3.Error as exc:
        raise StoreError(str(exc)) from exc
    try:
        yield db
        db.execute("COMMIT")
    except BaseException as exc:
        with contextlib.suppress(sqlite3.Error):  # SQLite may have rolled back already (disk full)
            db.execute("ROLLBACK")
        if isinstance(exc, sqlite3.Error):
            raise StoreError(str(exc)) from exc
        raise
