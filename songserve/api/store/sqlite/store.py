"""The SQLite engine of the job store: jobs and tracks in one file (WAL) under the state folder.

Everything a restart needs is here: the request, each track's status, attempts, worker, task id,
timings and metadata. The dispatcher's queue is rebuilt from it at start-up. All calls come from
the event-loop thread; each is a short local transaction.

``SqliteStore`` keeps the jobs and tracks; each other concern is a small connector on the same
connection, reached as an attribute: ``outbox`` (``store/sqlite/outbox.py``), ``uploads``
(``uploads.py``), ``members`` (``members.py``: the registry, presence and leases). What a state change
writes beside its track (its webhook events, the lease check of its fence, a key's quota at insert)
runs inside this store's own transaction, through those modules' helpers that take it.

The file is checked before the service opens it (``store/sqlite/check.py``: damage, an empty file
beside results, a newer schema); the schema itself is versioned and migrated forward in
``store/sqlite/migrations.py``.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from songserve.api.jobs.records import Job, Key, Track
from songserve.api.jobs.states import RUNNING, TERMINAL, TrackStatus
from songserve.api.store.members import Fence
from songserve.api.store.migrations import NewerSchemaError
from songserve.api.store.protocol import (
    STORED_TRACK_FIELDS,
    DuplicateKey,
    Events,
    LeaseLost,
    StaleTrack,
    StoreError,
    job_from_row,
    stored_value,
    work_ratios,
)
from songserve.api.store.quota import Quota, Usage
from songserve.api.store.sqlite.conn import BUSY_TIMEOUT_MS, configure, connect, transaction
from songserve.api.store.sqlite.members import SqliteMembers, holds
from songserve.api.store.sqlite.migrations import migrate
from songserve.api.store.sqlite.outbox import SqliteOutbox, insert_events
from songserve.api.store.sqlite.quota import check_quota, read_usage
from songserve.api.store.sqlite.uploads import SqliteUploads
from songserve.errors import ConfigError

TERMINAL_SQL = ", ".join(f"'{s.value}'" for s in sorted(TERMINAL))
RUNNING_SQL = ", ".join(f"'{s.value}'" for s in sorted(RUNNING))


class SqliteStore:
    """The SQLite engine of ``JobStore``: one file, one dispatcher. Open it after ``prepare_store``
    (``store/sqlite/check.py``).

    Calls come from the event-loop thread; each is a short local transaction, so they run inline.
    Events stay in the process (no other dispatcher can share the file), and ``exclusive`` always holds.
    """

    shared = False

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.where = str(path)
        self.db = connect(path)
        try:
            configure(self.db)
            migrate(self.db)
            self.ident = str(self.db.execute("SELECT value FROM store_meta WHERE name='store_id'").fetchone()[0])
        except NewerSchemaError as exc:
            self.db.close()
            raise ConfigError(newer_schema_message(path, exc)) from None
        except sqlite3.DatabaseError as exc:
            self.db.close()
            raise ConfigError(f"The job store {path} cannot be opened ({exc}).") from None
        self.outbox = SqliteOutbox(self.db)
        self.uploads = SqliteUploads(self.db)
        self.members = SqliteMembers(self.db)

    async def close(self) -> None:
        self.db.close()

    # ---- jobs and tracks -----------------------------------------------------------------------
    async def insert_job(self, job: Job, quota: Quota | None = None) -> None:
        with transaction(self.db) as db:
            if job.idempotency_key and (found := self._by_key(job.idempotency_key)):
                raise DuplicateKey(found)
            if quota is not None and quota.limited:
                check_quota(db, quota, len(job.tracks), job.created_at)
            job.seq = int(db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM jobs").fetchone()[0])
            db.execute(
                "INSERT INTO jobs (job_id, seq, created_at, priority, request, cleaned_lyrics, num_tracks,"
                " idempotency_key, caller) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (job.job_id, job.seq, job.created_at, job.priority, job.request.model_dump_json(),
                 job.cleaned_lyrics, len(job.tracks), job.idempotency_key, job.caller),
            )  # fmt: skip
            db.executemany(
                "INSERT INTO tracks (job_id, idx, status, seed) VALUES (?, ?, ?, ?)",
                [(t.job_id, t.index, t.status.value, t.seed) for t in job.tracks],
            )

    async def claim(self, tracks: list[Track], fence: Fence) -> set[int]:
        won: set[int] = set()
        with transaction(self.db) as db:  # the write lock makes the checks and the writes one step
            if tracks and not holds(db, fence):
                raise LeaseLost(tracks[0].key, fence)
            for t in tracks:
                if self._write_track(db, t, (TrackStatus.queued, None)):
                    won.add(t.index)
        return won

    async def save_track(
        self, t: Track, seen: tuple[TrackStatus, str | None], fence: Fence | None = None, events: Events = ()
    ) -> None:
        with transaction(self.db) as db:
            if fence is not None and not holds(db, fence):
                raise LeaseLost(t.key, fence)
            if not self._write_track(db, t, seen):
                raise StaleTrack(t.key)
            insert_events(db, events)

    def _write_track(self, db: sqlite3.Connection, t: Track, seen: tuple[TrackStatus, str | None]) -> bool:
        values = [stored_value(t, f) for f in STORED_TRACK_FIELDS]
        cur = db.execute(
            f"UPDATE tracks SET {', '.join(f + '=?' for f in STORED_TRACK_FIELDS)}"
            " WHERE job_id=? AND idx=? AND status=? AND owner IS ?",
            (*values, t.job_id, t.index, seen[0].value, seen[1]),
        )
        return cur.rowcount == 1

    async def save_progress(self, t: Track, fence: Fence | None = None) -> None:
        with transaction(self.db) as db:
            if fence is not None and not holds(db, fence):
                return
            db.execute(
                "UPDATE tracks SET worker_phase=?, phase_progress=?, phase_detail=?, phase_rate=?, preview_sec=?"
                " WHERE job_id=? AND idx=? AND owner IS ?",
                (
                    t.worker_phase,
                    t.phase_progress,
                    t.phase_detail,
                    t.phase_rate,
                    t.preview_sec,
                    t.job_id,
                    t.index,
                    t.owner,
                ),  # fmt: skip
            )

    async def mark_started(self, job_id: str, at: float, events: Events = ()) -> None:
        with transaction(self.db) as db:
            if db.execute("UPDATE jobs SET started_at=? WHERE job_id=? AND started_at IS NULL", (at, job_id)).rowcount:
                insert_events(db, events)

    async def mark_cancelled(self, job_id: str) -> None:
        with transaction(self.db) as db:
            db.execute("UPDATE jobs SET cancelled=1 WHERE job_id=?", (job_id,))

    async def finish_job(self, job_id: str, at: float, events: Events = ()) -> bool:
        with transaction(self.db) as db:
            cur = db.execute(
                "UPDATE jobs SET terminal=1, finished_at=COALESCE(finished_at, ?) WHERE job_id=? AND terminal=0"
                f" AND NOT EXISTS (SELECT 1 FROM tracks WHERE job_id=? AND status NOT IN ({TERMINAL_SQL}))",
                (at, job_id, job_id),
            )
            if cur.rowcount:
                insert_events(db, events)
            row = db.execute("SELECT terminal FROM jobs WHERE job_id=?", (job_id,)).fetchone()
        return bool(row and row[0])

    async def is_cancelled(self, job_id: str) -> bool:
        row = self.db.execute("SELECT cancelled FROM jobs WHERE job_id=?", (job_id,)).fetchone()
        return bool(row and row[0])

    def _by_key(self, key: str) -> str | None:
        row = self.db.execute("SELECT job_id FROM jobs WHERE idempotency_key=?", (key,)).fetchone()
        return row[0] if row else None

    async def job_by_key(self, key: str) -> str | None:
        return self._by_key(key)

    async def load_job(self, job_id: str) -> Job | None:
        row = self.db.execute("SELECT * FROM jobs WHERE job_id=?", (job_id,)).fetchone()
        if row is None:
            return None
        tracks = self.db.execute("SELECT * FROM tracks WHERE job_id=? ORDER BY idx", (job_id,)).fetchall()
        return job_from_row(row, tracks)

    async def active_jobs(self) -> list[Job]:
        jobs = self.db.execute("SELECT * FROM jobs WHERE terminal=0 ORDER BY seq").fetchall()
        tracks: dict[str, list[sqlite3.Row]] = {}
        for t in self.db.execute(
            "SELECT t.* FROM tracks t JOIN jobs j USING (job_id) WHERE j.terminal=0 ORDER BY t.job_id, t.idx"
        ).fetchall():
            tracks.setdefault(t["job_id"], []).append(t)
        return [job_from_row(r, tracks.get(r["job_id"], [])) for r in jobs]

    async def running_on(self, worker_id: int) -> list[Key]:
        rows = self.db.execute(
            f"SELECT job_id, idx FROM tracks WHERE worker_id=? AND status IN ({RUNNING_SQL})", (worker_id,)
        ).fetchall()
        return [(r[0], int(r[1])) for r in rows]

    async def expired_jobs(self, older_than: float) -> list[str]:
        rows = self.db.execute(
            "SELECT job_id FROM jobs WHERE terminal=1 AND finished_at < ? ORDER BY finished_at", (older_than,)
        ).fetchall()
        return [r[0] for r in rows]

    async def finished_jobs_oldest_first(self) -> list[str]:
        rows = self.db.execute("SELECT job_id FROM jobs WHERE terminal=1 ORDER BY finished_at").fetchall()
        return [r[0] for r in rows]

    async def job_ids(self) -> set[str]:
        return {r[0] for r in self.db.execute("SELECT job_id FROM jobs").fetchall()}

    async def jobs_newest_first(self, caller: str | None, below: int | None, limit: int) -> list[tuple[str, int]]:
        rows = self.db.execute(
            "SELECT job_id, seq FROM jobs WHERE (? IS NULL OR seq < ?) AND (? IS NULL OR caller = ?)"
            " ORDER BY seq DESC LIMIT ?",
            (below, below, caller, caller, limit),
        ).fetchall()
        return [(r[0], int(r[1])) for r in rows]

    async def delete_job(self, job_id: str) -> None:
        with transaction(self.db) as db:
            db.execute("DELETE FROM jobs WHERE job_id=?", (job_id,))

    async def counts(self) -> dict[str, int]:
        rows = self.db.execute("SELECT status, COUNT(*) FROM tracks GROUP BY status").fetchall()
        return {r[0]: int(r[1]) for r in rows}

    async def finished_work_ratios(self, limit: int = 200) -> list[tuple[str, float]]:
        rows = self.db.execute(
            "SELECT metadata, started_at, finished_at, duration_sec FROM tracks WHERE status='done'"
            " AND duration_sec > 0 ORDER BY finished_at DESC LIMIT ?",
            (limit,),
        ).fetchall()
        return work_ratios((r["metadata"], r["started_at"], r["finished_at"], r["duration_sec"]) for r in rows)

    async def usage(self, caller: str | None, since: float) -> Usage:
        return read_usage(self.db, caller, since)

    # ---- events and one-at-a-time work ---------------------------------------------------------
    @asynccontextmanager
    async def listen(self, on_change: Callable[[str], None]) -> AsyncIterator[None]:
        yield  # one dispatcher per file: there is nobody else to hear from

    @asynccontextmanager
    async def exclusive(self, name: str) -> AsyncIterator[bool]:
        yield True

    async def probe(self, timeout: float) -> None:
        """Take the write lock and let it go at once, waiting at most ``timeout`` for it (another process
        holding the file, a full disk); the usual wait (5 s) comes back afterwards."""
        db = self.db
        db.execute(f"PRAGMA busy_timeout = {max(1, int(timeout * 1000))}")
        try:
            db.execute("BEGIN IMMEDIATE")
            db.execute("SELECT 1 FROM jobs LIMIT 1").fetchall()
            db.execute("ROLLBACK")
        except sqlite3.Error as exc:
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK")
            raise StoreError(str(exc)) from exc
        finally:
            db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")


def newer_schema_message(path: Path, exc: NewerSchemaError) -> str:
    """The one line that refuses a store written by a newer build."""
    return exc.refusal(str(path), "STATE_DIR at another folder")
