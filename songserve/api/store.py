"""The job store: jobs and tracks in SQLite (WAL) under the state folder.

Everything a restart needs is here: the request, each track's status, attempts, worker, task id,
timings and metadata. The dispatcher's queue is rebuilt from it at start-up. All calls come from
the event-loop thread; each is a short local transaction.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from songserve.api.states import TrackStatus
from songserve.schemas import GenerateRequest

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,
    created_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    cancelled INTEGER NOT NULL DEFAULT 0,
    priority INTEGER NOT NULL DEFAULT 0,
    request TEXT NOT NULL,
    cleaned_lyrics TEXT NOT NULL,
    num_tracks INTEGER NOT NULL,
    idempotency_key TEXT UNIQUE,
    terminal INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS tracks (
    job_id TEXT NOT NULL REFERENCES jobs(job_id) ON DELETE CASCADE,
    idx INTEGER NOT NULL,
    status TEXT NOT NULL,
    seed INTEGER NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    worker_id INTEGER NOT NULL DEFAULT -1,
    task_id TEXT,
    error TEXT,
    duration_sec REAL NOT NULL DEFAULT 0,
    started_at REAL,
    finished_at REAL,
    metadata TEXT NOT NULL DEFAULT '{}',
    PRIMARY KEY (job_id, idx)
);
CREATE INDEX IF NOT EXISTS jobs_terminal ON jobs(terminal, finished_at);
CREATE INDEX IF NOT EXISTS tracks_status ON tracks(status);
"""


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
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute("PRAGMA foreign_keys=ON")
        self.db.executescript(SCHEMA)

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
