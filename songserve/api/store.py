"""The job store: jobs and tracks in SQLite (WAL) under the state folder.

Everything a restart needs is here: the request, each track's status, attempts, worker, task id,
timings and metadata. The dispatcher's queue is rebuilt from it at start-up. All calls come from
the event-loop thread; each is a short local transaction.

A store that cannot be trusted is never opened quietly (``prepare_store``): a file that is not
SQLite, fails ``PRAGMA quick_check``, is empty while results exist beside it, or carries a newer
schema refuses start-up with one line naming the file and what to do; with ``STORE_DAMAGED=move-aside``
a damaged file is renamed ``jobs.sqlite3.damaged-<UTC stamp>`` and a fresh store begins, said in
one log line. The schema itself is versioned and migrated forward in ``migrations.py``.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from songserve.api.migrations import SCHEMA_VERSION, NewerSchemaError, migrate, user_version
from songserve.api.states import TrackStatus
from songserve.errors import ConfigError
from songserve.schemas import GenerateRequest

log = logging.getLogger(__name__)
SQLITE_HEADER = b"SQLite format 3\x00"
DamagePolicy = Literal["refuse", "move-aside"]
DAMAGE_WORDS = ("malformed", "not a database", "corrupt")  # SQLite's words for a broken file


@dataclass
class Track:
    job_id: str
    index: int
    seed: int
    status: TrackStatus = TrackStatus.queued
    attempts: int = 0
    worker_id: int = -1
    task_id: str | None = None
    error: str | None = None
    duration_sec: float = 0.0
    started_at: float | None = None
    finished_at: float | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    # live, not persisted: refreshed from the worker's /health while the track runs
    worker_phase: str = "idle"  # a WorkerPhase word
    phase_progress: int = 0  # the worker's percent within that phase
    phase_detail: str = ""
    phase_rate: float | None = None  # tokens per second, in the backbone
    queued_at: float = 0.0  # when it last entered the queue (0: since its job was created)
    avoid_worker: int = -1  # its last attempt failed there for an environment reason: prefer another
    env_failures: int = 0  # attempts that failed for environment reasons (not counted as attempts)


@dataclass
class Job:
    job_id: str
    seq: int
    created_at: float
    request: GenerateRequest  # as accepted (after normalisation)
    cleaned_lyrics: str
    tracks: list[Track]
    priority: int = 0
    cancelled: bool = False
    started_at: float | None = None
    finished_at: float | None = None
    idempotency_key: str | None = None


class JobStore:
    """The open store. Open it after ``prepare_store`` has checked it (the dispatcher's entry does)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.db.row_factory = sqlite3.Row
        try:
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.execute("PRAGMA foreign_keys=ON")
            migrate(self.db)
        except NewerSchemaError as exc:
            self.db.close()
            raise ConfigError(_newer_message(path, exc)) from None
        except sqlite3.DatabaseError as exc:
            self.db.close()
            raise ConfigError(f"The job store {path} cannot be opened ({exc}).") from None

    def close(self) -> None:
        self.db.close()

    def next_seq(self) -> int:
        row = self.db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM jobs").fetchone()
        return int(row[0])

    def insert_job(self, job: Job) -> None:
        with self.db:
            self.db.execute("BEGIN")
            self.db.execute(
                "INSERT INTO jobs (job_id, seq, created_at, priority, request, cleaned_lyrics, num_tracks, idempotency_key)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    job.job_id,
                    job.seq,
                    job.created_at,
                    job.priority,
                    job.request.model_dump_json(),
                    job.cleaned_lyrics,
                    len(job.tracks),
                    job.idempotency_key,
                ),
            )
            self.db.executemany(
                "INSERT INTO tracks (job_id, idx, status, seed) VALUES (?, ?, ?, ?)",
                [(t.job_id, t.index, t.status.value, t.seed) for t in job.tracks],
            )

    def save_track(self, t: Track) -> None:
        self.db.execute(
            "UPDATE tracks SET status=?, seed=?, attempts=?, worker_id=?, task_id=?, error=?, duration_sec=?,"
            " started_at=?, finished_at=?, metadata=? WHERE job_id=? AND idx=?",
            (
                t.status.value,
                t.seed,
                t.attempts,
                t.worker_id,
                t.task_id,
                t.error,
                t.duration_sec,
                t.started_at,
                t.finished_at,
                json.dumps(t.metadata),
                t.job_id,
                t.index,
            ),
        )

    def save_job(self, job: Job, terminal: bool) -> None:
        self.db.execute(
            "UPDATE jobs SET started_at=?, finished_at=?, cancelled=?, terminal=? WHERE job_id=?",
            (job.started_at, job.finished_at, int(job.cancelled), int(terminal), job.job_id),
        )

    def job_by_key(self, key: str) -> str | None:
        row = self.db.execute("SELECT job_id FROM jobs WHERE idempotency_key=?", (key,)).fetchone()
        return row[0] if row else None

    def load_job(self, job_id: str) -> Job | None:
        row = self.db.execute("SELECT * FROM jobs WHERE job_id=?", (job_id,)).fetchone()
        if row is None:
            return None
        tracks = self.db.execute("SELECT * FROM tracks WHERE job_id=? ORDER BY idx", (job_id,)).fetchall()
        return _job(row, tracks)

    def active_jobs(self) -> Iterator[Job]:
        for row in self.db.execute("SELECT * FROM jobs WHERE terminal=0 ORDER BY seq").fetchall():
            tracks = self.db.execute("SELECT * FROM tracks WHERE job_id=? ORDER BY idx", (row["job_id"],)).fetchall()
            yield _job(row, tracks)

    def expired_jobs(self, older_than: float) -> list[str]:
        rows = self.db.execute(
            "SELECT job_id FROM jobs WHERE terminal=1 AND finished_at < ? ORDER BY finished_at", (older_than,)
        ).fetchall()
        return [r[0] for r in rows]

    def finished_jobs_oldest_first(self) -> list[str]:
        rows = self.db.execute("SELECT job_id FROM jobs WHERE terminal=1 ORDER BY finished_at").fetchall()
        return [r[0] for r in rows]

    def job_ids(self) -> set[str]:
        """Every job id in the store (for the orphan scan of the results folder)."""
        return {r[0] for r in self.db.execute("SELECT job_id FROM jobs").fetchall()}

    def delete_job(self, job_id: str) -> None:
        self.db.execute("DELETE FROM jobs WHERE job_id=?", (job_id,))

    def counts(self) -> dict[str, int]:
        rows = self.db.execute("SELECT status, COUNT(*) FROM tracks GROUP BY status").fetchall()
        return {r[0]: int(r[1]) for r in rows}

    def finished_work_ratios(self, limit: int = 200) -> list[tuple[str, float]]:
        """(backbone model, wall seconds per audio second) of recently finished tracks."""
        rows = self.db.execute(
            "SELECT metadata, started_at, finished_at, duration_sec FROM tracks WHERE status='done'"
            " AND duration_sec > 0 ORDER BY finished_at DESC LIMIT ?",
            (limit,),
        ).fetchall()
        out = []
        for r in rows:
            model = json.loads(r["metadata"]).get("models", {}).get("backbone", "")
            out.append((model, (r["finished_at"] - r["started_at"]) / r["duration_sec"]))
        return out


def _job(row: sqlite3.Row, tracks: list[sqlite3.Row]) -> Job:
    return Job(
        job_id=row["job_id"],
        seq=row["seq"],
        created_at=row["created_at"],
        request=GenerateRequest.model_validate_json(row["request"]),
        cleaned_lyrics=row["cleaned_lyrics"],
        priority=row["priority"],
        cancelled=bool(row["cancelled"]),
        started_at=row["started_at"],
        finished_at=row["finished_at"],
        idempotency_key=row["idempotency_key"],
        tracks=[
            Track(
                job_id=t["job_id"],
                index=t["idx"],
                seed=t["seed"],
                status=TrackStatus(t["status"]),
                attempts=t["attempts"],
                worker_id=t["worker_id"],
                task_id=t["task_id"],
                error=t["error"],
                duration_sec=t["duration_sec"],
                started_at=t["started_at"],
                finished_at=t["finished_at"],
                metadata=json.loads(t["metadata"]),
            )
            for t in tracks
        ],
    )


# -- start-up check ---------------------------------------------------------------------------------


def _newer_message(path: Path, exc: NewerSchemaError) -> str:
    return (
        f"The job store {path} has schema version {exc.found}, newer than this build's {exc.known}: "
        "run the newer songserve on it, or point STATE_DIR at another folder."
    )


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
            raise ConfigError(_newer_message(path, exc)) from None
        if problem is not None:
            if on_damage != "move-aside":
                raise ConfigError(
                    f"The job store {path} {problem}: restore it from a backup, or start with "
                    "STORE_DAMAGED=move-aside to keep it aside and begin a fresh store."
                )
            moved = move_aside(path)
            log.warning("job store %s %s: moved aside to %s; a fresh store begins", path, problem, moved)
        JobStore(path).close()  # creates or migrates under the lock
    return moved
