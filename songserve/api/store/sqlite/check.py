"""The SQLite store's start-up check: a store that cannot be trusted is never opened quietly.

``prepare_store`` runs before the service opens the store (``main.py``), under a file lock so one
process at a time checks, moves aside or migrates it: a file that is not SQLite, fails ``PRAGMA
quick_check``, is empty while results exist beside it, or carries a newer schema refuses start-up
with one line naming the file and what to do; with ``STORE_DAMAGED=move-aside`` a damaged file is
renamed ``jobs.sqlite3.damaged-<UTC stamp>`` and a fresh store begins, said in one log line. Kept
apart from the engine (``store/sqlite/store.py``): this runs once, before there is a service.
"""

from __future__ import annotations

import fcntl
import logging
import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

from songserve.api.store.migrations import NewerSchemaError
from songserve.api.store.sqlite.migrations import SCHEMA_VERSION, user_version
from songserve.api.store.sqlite.store import SqliteStore, newer_schema_message
from songserve.errors import ConfigError

log = logging.getLogger(__name__)
SQLITE_HEADER = b"SQLite format 3\x00"
DamagePolicy = Literal["refuse", "move-aside"]
DAMAGE_WORDS = ("malformed", "not a database", "corrupt")  # SQLite's words for a broken file


@contextmanager
def _store_lock(path: Path) -> Iterator[None]:
    """One process at a time checks, moves aside or migrates a store (a second dispatcher waits)."""
    with open(path.with_name(path.name + ".lock"), "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def diagnose(path: Path, results_dir: Path | None = None) -> str | None:
    """What is wrong with the store at ``path`` (a phrase), or None when it can be opened.

    A missing file is a new store. A 0-byte file is new only when no result folder exists beside
    it: otherwise jobs existed and the file lost them, and starting silently would orphan them.
    Raises ``NewerSchemaError`` for a store written by a newer build, and ``ConfigError`` when the
    file cannot be read for another reason (locked, I/O error): neither is damage, neither is moved aside.
    """
    if not path.exists():
        return None
    if not path.is_file():
        return "is not a file"
    size = path.stat().st_size
    if size == 0:
        if results_dir is not None and results_dir.is_dir() and any(results_dir.iterdir()):
            return f"is empty (0 bytes) although results exist in {results_dir}"
        return None
    with open(path, "rb") as f:
        if f.read(len(SQLITE_HEADER)) != SQLITE_HEADER:
            return "is not an SQLite database"
    try:
        db = sqlite3.connect(path, isolation_level=None)
        try:
            rows = db.execute("PRAGMA quick_check").fetchall()
            found = user_version(db)
        finally:
            db.close()
    except sqlite3.DatabaseError as exc:
        if not any(word in str(exc).lower() for word in DAMAGE_WORDS):
            # locked by another process, an I/O error, …: the file may be fine; never move it aside
            raise ConfigError(f"The job store {path} cannot be checked ({exc}); nothing was changed.") from None
        return f"is damaged ({exc})"
    if [tuple(r) for r in rows] != [("ok",)]:
        first = " ".join(str(rows[0][0]).split()) if rows else "no answer"
        return f"is damaged (quick_check: {first})"
    if found > SCHEMA_VERSION:
        raise NewerSchemaError(found, SCHEMA_VERSION)
    return None


def move_aside(path: Path) -> Path:
    """Rename the store (and its -wal/-shm) to ``<name>.damaged-<UTC stamp>``; returns the new path."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = path.with_name(f"{path.name}.damaged-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.damaged-{stamp}-{n}")
    for suffix in ("-wal", "-shm"):
        side = path.with_name(path.name + suffix)
        if side.exists():
            os.replace(side, target.with_name(target.name + suffix))
    os.replace(path, target)
    return target


def prepare_store(path: Path, on_damage: DamagePolicy = "refuse", results_dir: Path | None = None) -> Path | None:
    """Check the store before the service opens it; migrate it forward. Returns where a damaged one went.

    Raises ``ConfigError`` (one line: the file, the damage, what to do) when the store cannot be
    used and the policy is ``refuse``, or the schema is newer than this build's.
    """
    try:
        return _prepare(path, on_damage, results_dir)
    except OSError as exc:
        raise ConfigError(f"The job store {path} cannot be checked ({exc.strerror or exc}).") from None


def _prepare(path: Path, on_damage: DamagePolicy, results_dir: Path | None) -> Path | None:
    path.parent.mkdir(parents=True, exist_ok=True)
    moved: Path | None = None
    with _store_lock(path):
        try:
            problem = diagnose(path, results_dir)
        except NewerSchemaError as exc:
            raise ConfigError(newer_schema_message(path, exc)) from None
        if problem is not None:
            if on_damage != "move-aside":
                raise ConfigError(
                    f"The job store {path} {problem}: restore it from a backup, or start with "
                    "STORE_DAMAGED=move-aside to keep it aside and begin a fresh store."
                )
            moved = move_aside(path)
            log.warning("job store %s %s: moved aside to %s; a fresh store begins", path, problem, moved)
        SqliteStore(path).db.shutdown()  # creates or migrates under the lock
    return moved
