"""An upload as the job store keeps it, so that any dispatcher of a shared store answers for it.

One row per upload (table ``uploads``, schema version 6 of both engines, its key since 7). Its states are
``UploadStatus``'s: ``queued → encoding → ready | failed``, and ``encoding → queued`` when an attempt
ends without an answer (its worker went away or was busy, its dispatcher died: ``requeue``). The
rules both engines keep, as for tracks:
- an upload leaves the queue only through ``claim``, a compare-and-set on ``queued`` fenced
  by the lease of the worker it goes to (the same check as a track's claim), so one dispatcher
  encodes it at a time;
- ``finish`` and ``requeue`` change it only while it is ``encoding`` and owned by the
  writer, so an upload deleted, or taken over after its dispatcher was thought dead, is not written;
- ``requeue_stale`` sends back to the queue what a dead dispatcher (not among the live
  ones) or this one before a restart (owner itself, no attempt running) left ``encoding``.
``Uploads`` keeps them over either engine's connector (``store.uploads``, the ``UploadStore`` protocol
below; its SQL: ``store/queries/uploads.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol

from songserve.api.store.connector import Connector
from songserve.api.store.members import Fence, holds
from songserve.api.store.queries import uploads as q
from songserve.api.store.queries.uploads import UPLOAD_COLUMNS
from songserve.schemas import UploadStatus


@dataclass
class UploadRecord:
    upload_id: str
    created_at: float
    status: UploadStatus
    filename: str  # the client's name for the file, for people only (never a path)
    ext: str  # the stored file's extension, from its format (audio_in.AudioFacts.extension)
    bytes: int
    duration_sec: float  # at 44.1 kHz, as the dispatcher read it
    frames: int  # what the dispatcher expects; the worker's own count once ready
    source: dict[str, Any] = field(default_factory=dict)  # format, subtype, sample_rate, channels, frames
    error: str | None = None
    attempts: int = 0
    owner: str | None = None  # the dispatcher encoding it (None unless encoding)
    worker_id: int = -1
    started_at: float | None = None
    finished_at: float | None = None
    caller: str | None = None  # the name of the API key that sent it (None: no key)

    def values(self) -> list[object]:
        """The row's values in ``UPLOAD_COLUMNS`` order, as both engines store them."""
        out: list[object] = []
        for name in UPLOAD_COLUMNS:
            value = getattr(self, name)
            out.append(json.dumps(value) if name == "source" else value.value if name == "status" else value)
        return out


def upload_from_row(row: Any) -> UploadRecord:
    """An ``UploadRecord`` from a row of either engine (read by column name)."""
    kw = {name: row[name] for name in UPLOAD_COLUMNS}
    kw["status"] = UploadStatus(kw["status"])
    kw["source"] = json.loads(kw["source"]) if isinstance(kw["source"], str) else kw["source"]
    return UploadRecord(**kw)


class UploadStore(Protocol):
    """``JobStore.uploads``: the uploads' rows (every method one short transaction)."""

    async def insert(self, u: UploadRecord) -> None: ...
    async def load(self, upload_id: str) -> UploadRecord | None: ...
    async def queued(self, limit: int) -> list[UploadRecord]:
        """The oldest queued uploads first."""

    async def claim(self, upload_id: str, fence: Fence) -> bool:
        """``queued`` → ``encoding`` on the worker ``fence`` names, while its lease holds; whether it was won."""

    async def finish(self, u: UploadRecord, owner: str) -> bool:
        """Write ``u``'s end (``ready`` with its frames, or ``failed`` with its error) if ``owner`` still encodes it."""

    async def requeue(self, upload_id: str, owner: str, error: str, count: bool = True) -> bool:
        """``encoding`` → ``queued`` if ``owner`` encodes it; ``count`` False: the try is not counted."""

    async def requeue_stale(self, alive: set[str], me: str, running: set[str]) -> int:
        """Uploads left ``encoding`` by a dispatcher not in ``alive``, or by ``me`` with no attempt in
        ``running``, back to the queue; returns how many."""

    async def delete(self, upload_id: str) -> bool: ...
    async def expired(self, older_than: float) -> list[str]: ...
    async def finished_oldest_first(self) -> list[tuple[str, str]]:
        """Finished jobs and uploads, oldest first: (``job`` or ``upload``, its id)."""

    async def ids(self) -> set[str]: ...
    async def counts(self) -> dict[str, int]: ...


class Uploads:
    """``UploadStore`` over the store's connector."""

    def __init__(self, conn: Connector) -> None:
        self.conn = conn

    async def insert(self, u: UploadRecord) -> None:
        await self.conn.execute(q.INSERT, u.values())

    async def load(self, upload_id: str) -> UploadRecord | None:
        row = await self.conn.fetch_one(q.LOAD, (upload_id,))
        return upload_from_row(row) if row else None

    async def queued(self, limit: int) -> list[UploadRecord]:
        return [upload_from_row(r) for r in await self.conn.fetch_all(q.QUEUED, (limit,))]

    async def claim(self, upload_id: str, fence: Fence) -> bool:
        async with self.conn.transaction() as tx:
            if not await holds(tx, fence) or await tx.fetch_one(q.LOCK_QUEUED, (upload_id,)) is None:
                return False
            return await tx.execute(q.CLAIM, (fence.owner, fence.worker_id, upload_id)) == 1

    async def finish(self, u: UploadRecord, owner: str) -> bool:
        params = (u.status.value, u.frames, u.error, u.finished_at, u.upload_id, owner)
        return await self.conn.execute(q.FINISH, params) == 1

    async def requeue(self, upload_id: str, owner: str, error: str, count: bool = True) -> bool:
        return await self.conn.execute(q.REQUEUE, (error, 0 if count else 1, upload_id, owner)) == 1

    async def requeue_stale(self, alive: set[str], me: str, running: set[str]) -> int:
        async with self.conn.transaction() as tx:
            rows = await tx.fetch_all(q.ENCODING)
            stale = [
                r["upload_id"]
                for r in rows
                if r["owner"] not in alive or (r["owner"] == me and r["upload_id"] not in running)
            ]
            await tx.execute_many(q.REQUEUE_STALE, [(upload_id,) for upload_id in stale])
        return len(stale)

    async def delete(self, upload_id: str) -> bool:
        return await self.conn.execute(q.DELETE, (upload_id,)) == 1

    async def expired(self, older_than: float) -> list[str]:
        return [r["upload_id"] for r in await self.conn.fetch_all(q.EXPIRED, (older_than,))]

    async def finished_oldest_first(self) -> list[tuple[str, str]]:
        return [(r["kind"], r["id"]) for r in await self.conn.fetch_all(q.FINISHED_OLDEST_FIRST)]

    async def ids(self) -> set[str]:
        return {r["upload_id"] for r in await self.conn.fetch_all(q.IDS)}

    async def counts(self) -> dict[str, int]:
        return {UploadStatus(r["status"]).value: int(r["n"]) for r in await self.conn.fetch_all(q.COUNTS)}
