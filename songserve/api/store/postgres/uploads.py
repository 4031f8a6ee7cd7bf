"""The PostgreSQL store's uploads connector (``store.uploads``; ``store/uploads.py`` has the protocol and the rules).

Claims lock the row (``FOR UPDATE SKIP LOCKED``) and check the worker's lease in the same statement
(``lease_cte``, as a track's claim does), so two dispatchers never encode one upload at once; times
that decide take-overs are the database's clock (``NOW``).
"""

from __future__ import annotations

from songserve.api.store.members import Fence
from songserve.api.store.postgres.conn import NOW, PgLanes
from songserve.api.store.postgres.members import lease_cte
from songserve.api.store.uploads import UPLOAD_COLUMNS, UploadRecord, upload_from_row

TERMINAL_UPLOADS = ["ready", "failed"]


class PgUploads:
    """``UploadStore`` over the store's connections (``db``: the calling lane's pool)."""

    def __init__(self, db: PgLanes) -> None:
        self.db = db

    async def insert(self, u: UploadRecord) -> None:
        marks = ", ".join("%s" for _ in UPLOAD_COLUMNS)
        await self.db.rows(
            f"INSERT INTO uploads ({', '.join(UPLOAD_COLUMNS)}) VALUES ({marks}) RETURNING upload_id", u.values()
        )

    async def load(self, upload_id: str) -> UploadRecord | None:
        rows = await self.db.read("SELECT * FROM uploads WHERE upload_id=%s", (upload_id,))
        return upload_from_row(rows[0]) if rows else None

    async def queued(self, limit: int) -> list[UploadRecord]:
        rows = await self.db.read("SELECT * FROM uploads WHERE status='queued' ORDER BY created_at LIMIT %s", (limit,))
        return [upload_from_row(r) for r in rows]

    async def claim(self, upload_id: str, fence: Fence) -> bool:
        lease, params = lease_cte(fence)
        rows = await self.db.rows(
            f"WITH {lease}, locked AS (SELECT upload_id FROM uploads WHERE upload_id=%s AND status='queued'"
            " AND EXISTS (SELECT 1 FROM lease) FOR UPDATE SKIP LOCKED),"
            " claimed AS (UPDATE uploads SET status='encoding', owner=%s, worker_id=%s, attempts=attempts+1,"
            f" started_at={NOW} WHERE upload_id IN (SELECT upload_id FROM locked) RETURNING upload_id)"
            " SELECT count(*) AS won FROM claimed",
            [*params, upload_id, fence.owner, fence.worker_id],
        )
        return bool(rows[0]["won"])

    async def finish(self, u: UploadRecord, owner: str) -> bool:
        rows = await self.db.rows(
            "UPDATE uploads SET status=%s, frames=%s, error=%s, owner=NULL, finished_at=%s"
            " WHERE upload_id=%s AND status='encoding' AND owner=%s RETURNING upload_id",
            (u.status.value, u.frames, u.error, u.finished_at, u.upload_id, owner),
        )
        return bool(rows)

    async def requeue(self, upload_id: str, owner: str, error: str, count: bool = True) -> bool:
        rows = await self.db.rows(
            "UPDATE uploads SET status='queued', owner=NULL, worker_id=-1, error=%s, attempts=attempts-%s"
            " WHERE upload_id=%s AND status='encoding' AND owner=%s RETURNING upload_id",
            (error, 0 if count else 1, upload_id, owner),
        )
        return bool(rows)

    async def requeue_stale(self, alive: set[str], me: str, running: set[str]) -> int:
        rows = await self.db.rows(
            "UPDATE uploads SET status='queued', owner=NULL, worker_id=-1 WHERE status='encoding'"
            " AND (owner IS NULL OR NOT (owner = ANY(%s)) OR (owner=%s AND NOT (upload_id = ANY(%s))))"
            " RETURNING upload_id",
            (sorted(alive), me, sorted(running)),
        )
        return len(rows)

    async def delete(self, upload_id: str) -> bool:
        return bool(await self.db.rows("DELETE FROM uploads WHERE upload_id=%s RETURNING upload_id", (upload_id,)))

    async def expired(self, older_than: float) -> list[str]:
        rows = await self.db.read(
            "SELECT upload_id FROM uploads WHERE status = ANY(%s) AND finished_at < %s ORDER BY finished_at",
            (TERMINAL_UPLOADS, older_than),
        )
        return [r["upload_id"] for r in rows]

    async def finished_oldest_first(self) -> list[tuple[str, str]]:
        rows = await self.db.read(
            "SELECT 'job' AS kind, job_id AS id, finished_at FROM jobs WHERE terminal UNION ALL"
            " SELECT 'upload', upload_id, finished_at FROM uploads WHERE status = ANY(%s) ORDER BY finished_at",
            (TERMINAL_UPLOADS,),
        )
        return [(r["kind"], r["id"]) for r in rows]

    async def ids(self) -> set[str]:
        return {r["upload_id"] for r in await self.db.read("SELECT upload_id FROM uploads")}

    async def counts(self) -> dict[str, int]:
        rows = await self.db.read("SELECT status, COUNT(*) AS n FROM uploads GROUP BY status")
        return {r["status"]: int(r["n"]) for r in rows}
