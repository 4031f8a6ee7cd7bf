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
Each engine keeps them in a small connector (``store.uploads``, the ``UploadStore`` protocol below):
``store/sqlite/uploads.py`` and ``store/postgres/uploads.py``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol

from songserve.api.store.members import Fence
from songserve.schemas import UploadStatus

UPLOAD_COLUMNS = (
    "upload_id", "created_at", "status", "filename", "ext", "bytes", "duration_sec", "frames", "source", "error",
    "attempts", "owner", "worker_id", "started_at", "finished_at", "caller",
)  # fmt: skip


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
