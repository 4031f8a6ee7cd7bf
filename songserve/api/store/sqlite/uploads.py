"""The SQLite store's uploads connector (``store.uploads``; ``store/uploads.py`` has the protocol and the rules).

A claim checks the worker's lease with the membership connector's ``holds`` inside its own write
transaction, as a track's claim does.
"""

from __future__ import annotations

import sqlite3
import time

from songserve.api.store.members import Fence
from songserve.api.store.sqlite.conn import transaction
from songserve.api.store.sqlite.members import holds
from songserve.api.store.uploads import UPLOAD_COLUMNS, UploadRecord, upload_from_row
from songserve.schemas import UploadStatus

TERMINAL_UPLOADS = "('ready', 'failed')"


class SqliteUploads:
    """``UploadStore`` over the store's connection (one file, one dispatcher)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    async def insert(self, u: UploadRecord) -> None:
        with transaction(self.db) as db:
            marks = ", ".join("?" for _ in UPLOAD_COLUMNS)
            db.execute(f"INSERT INTO uploads ({', '.join(UPLOAD_COLUMNS)}) VALUES ({marks})", u.values())

    async def load(self, upload_id: str) -> UploadRecord | None:
        row = self.db.execute("SELECT * FROM uploads WHERE upload_id=?", (upload_id,)).fetchone()
        return upload_from_row(row) if row else None

    async def queued(self, limit: int) -> list[UploadRecord]:
        rows = self.db.execute(
            "SELECT * FROM uploads WHERE status='queued' ORDER BY created_at LIMIT ?", (limit,)
        ).fetchall()
        return [upload_from_row(r) for r in rows]

    async def claim(self, upload_id: str, fence: Fence) -> bool:
        with transaction(self.db) as db:
            if not holds(db, fence):
                return False
            cur = db.execute(
                "UPDATE uploads SET status='encoding', owner=?, worker_id=?, attempts=attempts+1, started_at=?"
                " WHERE upload_id=? AND status='queued'",
                (fence.owner, fence.worker_id, time.time(), upload_id),
            )
            return cur.rowcount == 1

    async def finish(self, u: UploadRecord, owner: str) -> bool:
        with transaction(self.db) as db:
            cur = db.execute(
                "UPDATE uploads SET status=?, frames=?, error=?, owner=NULL, finished_at=?"
                " WHERE upload_id=? AND status='encoding' AND owner=?",
                (u.status.value, u.frames, u.error, u.finished_at, u.upload_id, owner),
            )
            return cur.rowcount == 1

    async def requeue(self, upload_id: str, owner: str, error: str, count: bool = True) -> bool:
        with transaction(self.db) as db:
            cur = db.execute(
                "UPDATE uploads SET status='queued', owner=NULL, worker_id=-1, error=?, attempts=attempts-?"
                " WHERE upload_id=? AND status='encoding' AND owner=?",
                (error, 0 if count else 1, upload_id, owner),
            )
            return cur.rowcount == 1

    async def requeue_stale(self, alive: set[str], me: str, running: set[str]) -> int:
        with transaction(self.db) as db:
            rows = db.execute("SELECT upload_id, owner FROM uploads WHERE status='encoding'").fetchall()
            stale = [r[0] for r in rows if r[1] not in alive or (r[1] == me and r[0] not in running)]
            for upload_id in stale:
                db.execute(
                    "UPDATE uploads SET status='queued', owner=NULL, worker_id=-1 WHERE upload_id=? AND status='encoding'",
                    (upload_id,),
                )
            return len(stale)

    async def delete(self, upload_id: str) -> bool:
        with transaction(self.db) as db:
            return db.execute("DELETE FROM uploads WHERE upload_id=?", (upload_id,)).rowcount == 1

    async def expired(self, older_than: float) -> list[str]:
        rows = self.db.execute(
            f"SELECT upload_id FROM uploads WHERE status IN {TERMINAL_UPLOADS} AND finished_at < ? ORDER BY finished_at",
            (older_than,),
        ).fetchall()
        return [r[0] for r in rows]

    async def finished_oldest_first(self) -> list[tuple[str, str]]:
        rows = self.db.execute(
            "SELECT 'job', job_id, finished_at FROM jobs WHERE terminal=1 UNION ALL SELECT 'upload', upload_id,"
            f" finished_at FROM uploads WHERE status IN {TERMINAL_UPLOADS} ORDER BY 3"
        ).fetchall()
        return [(r[0], r[1]) for r in rows]

    async def ids(self) -> set[str]:
        return {r[0] for r in self.db.execute("SELECT upload_id FROM uploads").fetchall()}

    async def counts(self) -> dict[str, int]:
        rows = self.db.execute("SELECT status, COUNT(*) FROM uploads GROUP BY status").fetchall()
        return {UploadStatus(r[0]).value: int(r[1]) for r in rows}
