"""The SQLite store's outbox connector (``store.outbox``): the webhook events' claims, tries and sweeps.

``SqliteOutbox``'s methods are the ``webhooks`` loop's calls (``webhooks/sender.py``). ``insert_events``
writes a state change's events inside the jobs store's own transaction (``store/sqlite/store.py``),
so an event exists exactly when the change it reports does. The outbox's rules: ``store/outbox.py``.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Sequence

from songserve.api.store.outbox import Delivery, OutboxStats, WebhookEvent, delivery_from_row, event_columns
from songserve.api.store.sqlite.conn import transaction

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


class SqliteOutbox:
    """``Outbox`` over the store's connection."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    async def add_progress(self, event: WebhookEvent, min_gap: float) -> bool:
        now = time.time()
        with transaction(self.db) as db:
            cur = db.execute(
                "UPDATE jobs SET progress_event_at=? WHERE job_id=? AND terminal=0 AND progress_event_at <= ?",
                (now, event.job_id, now - min_gap),
            )
            if cur.rowcount != 1:
                return False
            insert_events(db, [event])
        return True

    async def claim(self, owner: str, limit: int, lease_sec: float) -> list[Delivery]:
        now = time.time()
        if self.db.execute(f"SELECT 1 {DUE} LIMIT 1", (now, now)).fetchone() is None:
            return []  # the usual answer, without the write lock
        with transaction(self.db) as db:
            rows = db.execute(f"SELECT e.* {DUE} ORDER BY e.id LIMIT ?", (now, now, limit)).fetchall()
            db.executemany(
                "UPDATE webhook_events SET lease_owner=?, lease_until=? WHERE id=?",
                [(owner, now + lease_sec, r["id"]) for r in rows],
            )
        return [delivery_from_row(r) for r in rows]

    async def delivered(self, row: int) -> None:
        with transaction(self.db) as db:
            db.execute(
                "UPDATE webhook_events SET state='delivered', ended_at=?, lease_owner=NULL, lease_until=0"
                " WHERE id=? AND state='pending'",
                (time.time(), row),
            )

    async def failed(self, row: int, owner: str, error: str, retry_in: float | None) -> None:
        now = time.time()
        with transaction(self.db) as db:
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

    async def release(self, owner: str) -> None:
        with transaction(self.db) as db:
            db.execute(
                "UPDATE webhook_events SET lease_owner=NULL, lease_until=0 WHERE lease_owner=? AND state='pending'",
                (owner,),
            )

    async def stats(self) -> OutboxStats:
        n, oldest = self.db.execute(
            "SELECT COUNT(*), MIN(created_at) FROM webhook_events WHERE state='pending'"
        ).fetchone()
        return OutboxStats(int(n), oldest)

    async def sweep(self, ended_before: float) -> int:
        with transaction(self.db) as db:
            cur = db.execute("DELETE FROM webhook_events WHERE state <> 'pending' AND ended_at < ?", (ended_before,))
        return int(cur.rowcount)
