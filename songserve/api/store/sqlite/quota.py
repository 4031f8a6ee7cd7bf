"""A key's usage as the SQLite store reads it, and its quota checked in the job insert's transaction.

The jobs store (``store/sqlite/store.py``) calls ``check_quota`` inside the insert's ``BEGIN IMMEDIATE``:
the write lock makes the count and the insert one step. The limits themselves: ``store/quota.py``.
"""

from __future__ import annotations

import sqlite3

from songserve.api.store.quota import WINDOW_SEC, Quota, Usage, check


def read_usage(db: sqlite3.Connection, caller: str | None, since: float) -> Usage:
    """A key name's unfinished jobs, and (submitted at, tracks) of its jobs since ``since``, oldest first."""
    active = db.execute("SELECT COUNT(*) FROM jobs WHERE caller IS ? AND terminal=0", (caller,)).fetchone()[0]
    recent = db.execute(
        "SELECT created_at, num_tracks FROM jobs WHERE caller IS ? AND created_at > ? ORDER BY created_at",
        (caller, since),
    ).fetchall()
    return Usage(int(active), [(float(r[0]), int(r[1])) for r in recent])


def check_quota(db: sqlite3.Connection, quota: Quota, wanted: int, now: float) -> None:
    """In the insert's transaction (the write lock): raise ``OverQuota`` if the job is over a limit."""
    check(quota, read_usage(db, quota.caller, now - WINDOW_SEC), wanted, now)
