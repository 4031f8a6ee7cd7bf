"""The SQLite store's webhook outbox and key usage: ``SqliteStore`` mixes these in.

Kept apart from the jobs and tracks (``store/sqlite/store.py``) so each stays readable. ``insert_events``
and ``check_quota`` run inside the store's own transactions (the state change's, the job insert's);
the rest are the ``webhooks`` loop's calls (``webhooks/sender.py``). The outbox's rules: ``store/outbox.py``.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager

from songserve.api.store.outbox import Delivery, OutboxStats, WebhookEvent, delivery_from_row, event_columns
from songserve.api.store.quota import WINDOW_SEC, Quota, Usage, check

# The due events, each the oldest pending one of its job (so a job's events go out in order).
DUE = (
    "FROM webhook_events e WHERE state='pending' AND next_at <= ? AND lease_until <= ? AND NOT EXISTS"
    " (SELECT 1 FROM webhook_events p WHERE p.job_id = e.job_id AND p.state='pending' AND p.id < e.id)"
)


def insert_events(db: sqlite3.Connection, events: Sequence[WebhookEvent]) -> None:
    """Write ``events`` in the caller's transaction."""
    if events:
        db.executemany(
            "INSERT INTO webhook_events (event_id, job_id, kind, url, body, created_at) VALUES (?, ?, ?, ?, ?, ?)",
            list(zip(*event_columns(list(events)), strict=True)),
        )


def read_usage(db: sqlite3.Connection, caller: str | None, since: float) -> Usage:
    active = db.execute("SELECT COUNT(*) FROM jobs WHERE caller IS ? AND terminal=0", (caller,)).fetchone()[0]
    recent = db.execute(
        "SELECT created_at, num_tracks FROM jobs WHERE caller IS ? AND created_at > ? ORDER BY created_at",
        (caller, since),
    ).fetchall()
    return Usage(int(active), [(float(r[0]), int(r[1])) for r in recent])


def check_quota(db: sqlite3.Connection, quota: Quota, wanted: int, now: float) -> None:
    """In the insert's transaction (the write lock): raise ``OverQuota`` if the job is over a limit."""
    check(quota, read_usage(db, quota.caller, now - WINDOW_SEC), wanted, now)


class SqliteOutbox:
    """``JobStore``'s outbox and usage methods over ``db`` (the store's connection)."""

    db: sqlite3.Connection

    def _tx(self) -> AbstractContextManager[sqlite3.Connection]:
        raise NotImplementedError  # SqliteStore: one write transaction

    async def usage(self, caller: str | None, since: float) -> Usage:
        return read_usage(self.db, caller, since)

    async def add_progress_event(self, event: WebhookEvent, min_gap: float) -> bool:
        now = time.time()
        with self._tx() as db:
            cur = db.execute(
                "UPDATE jobs SET progress_event_at=? WHERE job_id=? AND terminal=0 AND progress_event_at <= ?",
                (now, event.job_id, now - min_gap),
            )
            if cur.rowcount != 1:
                return False
            insert_events(db, [event])
        return True

    async def claim_events(self, owner: str, limit: int, lease_sec: float) -> list[Delivery]:
        now = time.time()
        if self.db.execute(f"SELECT 1 {DUE} LIMIT 1", (now, now)).fetchone() is None:
            return []  # the usual answer, without the write lock
        with self._tx() as db:
            rows = db.execute(f"SELECT e.* {DUE} ORDER BY e.id LIMIT ?", (now, now, limit)).fetchall()
            db.executemany(
                "UPDATE webhook_events SET lease_owner=?, lease_until=? WHERE id=?",
                [(owner, now + lease_sec, r["id"]) for r in rows],
            )
        return [delivery_from_row(r) for r in rows]

    async def event_delivered(self, row: int) -> None:
        with self._tx() as db:
            db.execute(
                "UPDATE webhook_events SET state='delivered', ended_at=?, lease_owner=NULL, lease_until=0"
                " WHERE id=? AND state='pending'",
                (time.time(), row),
            )

    async def event_failed(self, row: int, owner: str, error: str, retry_in: float | None) -> None:
        now = time.time()
        with self._tx() as db:
            if retry_in is None:
                db.execute(
                    "UPDATE webhook_events SET state='failed', ended_at=?, attempts=attempts+1, last_error=?,"
                    " lease_owner=NULL, lease_until=0 WHERE id=? AND state='pending' AND lease_owner=?",
                    (now, error, row, owner),
                )
            else:
                db.execute(
                    "UPDATE webhook_events SET next_at=?, attempts=attempts+1, last_error=?, lease_owner=NULL,"
                    " lease_until=0 WHERE id=? AND state='pending' AND lease_owner=?",
                    (now + retry_in, error, row, owner),
                )

    async def release_events(self, owner: str) -> None:
        with self._tx() as db:
            db.execute(
                "UPDATE webhook_events SET lease_owner=NULL, lease_until=0 WHERE lease_owner=? AND state='pending'",
                (owner,),
            )

    async def outbox_stats(self) -> OutboxStats:
        n, oldest = self.db.execute(
            "SELECT COUNT(*), MIN(created_at) FROM webhook_events WHERE state='pending'"
        ).fetchone()
        return OutboxStats(int(n), oldest)

    async def sweep_events(self, ended_before: float) -> int:
        with self._tx() as db:
            cur = db.execute("DELETE FROM webhook_events WHERE state <> 'pending' AND ended_at < ?", (ended_before,))
        return int(cur.rowcount)
