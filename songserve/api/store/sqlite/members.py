"""The SQLite store's membership connector (``store.members``): the worker registry, presence and leases.

One dispatcher uses a SQLite file, so these rows mostly say what it already knows; they are kept all
the same so the dispatcher's code is the same over either engine (``store/members.py`` has the
protocol and the rules). Times are this process's clock. ``holds`` is the fence check the jobs store
and the uploads connector run inside their own write transactions.
"""

from __future__ import annotations

import sqlite3
import time

from songserve.api.store.members import Fence, WorkerRow
from songserve.api.store.sqlite.conn import transaction


def holds(db: sqlite3.Connection, fence: Fence) -> bool:
    """In the caller's transaction: the fence's lease row says what the fence says, and has not expired."""
    row = db.execute(
        "SELECT 1 FROM workers WHERE worker_id=? AND lease_owner=? AND lease_epoch=? AND lease_until > ?",
        (fence.worker_id, fence.owner, fence.epoch, time.time()),
    ).fetchone()
    return row is not None


class SqliteMembers:
    """``MemberStore`` over the store's connection."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    async def register(self, url: str, ttl: float, announced: bool) -> int:
        until = time.time() + ttl
        with transaction(self.db) as db:
            row = db.execute("SELECT worker_id FROM workers WHERE url=?", (url,)).fetchone()
            if row is not None:
                db.execute(
                    "UPDATE workers SET registered_until=MAX(registered_until, ?), announced=? WHERE worker_id=?",
                    (until, int(announced), row[0]),
                )
                return int(row[0])
            worker_id = int(db.execute("SELECT COALESCE(MAX(worker_id) + 1, 0) FROM workers").fetchone()[0])
            db.execute(
                "INSERT INTO workers (worker_id, url, announced, registered_until) VALUES (?, ?, ?, ?)",
                (worker_id, url, int(announced), until),
            )
            return worker_id

    async def withdraw(self, worker_id: int) -> bool:
        with transaction(self.db) as db:
            cur = db.execute("UPDATE workers SET registered_until=0 WHERE worker_id=? AND registered_until>0",
                             (worker_id,))  # fmt: skip
            return cur.rowcount == 1

    async def live_workers(self) -> list[WorkerRow]:
        now = time.time()
        rows = self.db.execute(
            "SELECT worker_id, url, announced, CASE WHEN lease_until > ? THEN lease_owner END FROM workers"
            " WHERE registered_until > ? ORDER BY worker_id",
            (now, now),
        ).fetchall()
        return [WorkerRow(int(r[0]), r[1], bool(r[2]), r[3]) for r in rows]

    async def heartbeat(self, dispatcher_id: str, ttl: float) -> set[str]:
        now = time.time()
        with transaction(self.db) as db:
            db.execute("INSERT OR REPLACE INTO dispatchers VALUES (?, ?)", (dispatcher_id, now + ttl))
            db.execute("DELETE FROM dispatchers WHERE alive_until < ?", (now - 3600,))
            rows = db.execute("SELECT dispatcher_id FROM dispatchers WHERE alive_until > ?", (now,)).fetchall()
            return {r[0] for r in rows}

    async def leave(self, dispatcher_id: str) -> None:
        with transaction(self.db) as db:
            db.execute("DELETE FROM dispatchers WHERE dispatcher_id=?", (dispatcher_id,))
            db.execute("UPDATE workers SET lease_owner=NULL, lease_until=0 WHERE lease_owner=?", (dispatcher_id,))

    async def renew_leases(self, owner: str, ttl: float) -> dict[int, int]:
        now = time.time()
        with transaction(self.db) as db:
            db.execute(
                "UPDATE workers SET lease_until=? WHERE lease_owner=? AND lease_until > ?", (now + ttl, owner, now)
            )
            rows = db.execute(
                "SELECT worker_id, lease_epoch FROM workers WHERE lease_owner=? AND lease_until > ?", (owner, now)
            )
            return {int(r[0]): int(r[1]) for r in rows.fetchall()}

    async def acquire_lease(self, owner: str, worker_id: int, ttl: float) -> int | None:
        now = time.time()
        with transaction(self.db) as db:
            # The epoch stays only for a renewal by the holder of an unexpired lease (as in store/postgres/members.py).
            cur = db.execute(
                "UPDATE workers SET lease_epoch = lease_epoch + (CASE WHEN lease_owner IS ? AND lease_until > ?"
                " THEN 0 ELSE 1 END), lease_owner=?, lease_until=? WHERE worker_id=? AND registered_until > ?"
                " AND (lease_owner IS NULL OR lease_owner=? OR lease_until <= ?)",
                (owner, now, owner, now + ttl, worker_id, now, owner, now),
            )
            if cur.rowcount != 1:
                return None
            return int(db.execute("SELECT lease_epoch FROM workers WHERE worker_id=?", (worker_id,)).fetchone()[0])

    async def release_lease(self, owner: str, worker_id: int) -> None:
        with transaction(self.db) as db:
            db.execute(
                "UPDATE workers SET lease_owner=NULL, lease_until=0 WHERE worker_id=? AND lease_owner=?",
                (worker_id, owner),
            )
