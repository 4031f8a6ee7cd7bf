"""The SQLite job store's schema steps, in SQLite's SQL; its version is SQLite's ``PRAGMA user_version``.

The steps are run by the store's one runner (``store/migrations.py``), each in its own ``BEGIN
IMMEDIATE`` transaction with its version bump; PostgreSQL walks the same numbered steps in its own SQL
(``store/postgres/migrations.py``). To change the schema: append a step with the next number to both;
never edit a step that has shipped. ``user_version`` is read by the start-up check (``check.py``) on a
connection of its own, before the store is opened.
"""

from __future__ import annotations

import sqlite3

from songserve.api.store.migrations import Migration

# Version 1 is the schema every store had before versioning (user_version 0): ``IF NOT EXISTS``
# makes it a no-op on such a store and a creation on a new one.
V1_JOBS = """
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
)"""
V1_TRACKS = """
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
)"""

# The durable outbox (``store/outbox.py``): one row per event, written in the transaction of the state
# change it reports; ``id`` orders a job's events (AUTOINCREMENT: never reused).
V5_WEBHOOK_EVENTS = """
CREATE TABLE webhook_events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    event_id TEXT NOT NULL UNIQUE,
    job_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    url TEXT NOT NULL,
    body TEXT NOT NULL,
    created_at REAL NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending',
    attempts INTEGER NOT NULL DEFAULT 0,
    next_at REAL NOT NULL DEFAULT 0,
    lease_owner TEXT,
    lease_until REAL NOT NULL DEFAULT 0,
    last_error TEXT,
    ended_at REAL
)"""


MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "jobs and tracks",
        (
            V1_JOBS,
            V1_TRACKS,
            "CREATE INDEX IF NOT EXISTS jobs_terminal ON jobs(terminal, finished_at)",
            "CREATE INDEX IF NOT EXISTS tracks_status ON tracks(status)",
        ),
    ),
    Migration(
        2,
        "shared-store fields: track owner and progress, the worker registry, dispatchers",
        (
            "ALTER TABLE tracks ADD COLUMN owner TEXT",
            "ALTER TABLE tracks ADD COLUMN worker_phase TEXT NOT NULL DEFAULT 'idle'",
            "ALTER TABLE tracks ADD COLUMN phase_progress INTEGER NOT NULL DEFAULT 0",
            "ALTER TABLE tracks ADD COLUMN phase_detail TEXT NOT NULL DEFAULT ''",
            "ALTER TABLE tracks ADD COLUMN phase_rate REAL",
            "CREATE INDEX tracks_worker ON tracks(worker_id, status)",
            """CREATE TABLE workers (
                worker_id INTEGER PRIMARY KEY,
                url TEXT NOT NULL UNIQUE,
                announced INTEGER NOT NULL DEFAULT 0,
                registered_until REAL NOT NULL,
                lease_owner TEXT,
                lease_until REAL NOT NULL DEFAULT 0
            )""",
            "CREATE TABLE dispatchers (dispatcher_id TEXT PRIMARY KEY, alive_until REAL NOT NULL)",
        ),
    ),
    Migration(
        3,
        "fencing: a lease epoch per worker, and the store's own id (the epochs' namespace on a worker)",
        (
            "ALTER TABLE workers ADD COLUMN lease_epoch INTEGER NOT NULL DEFAULT 0",
            "CREATE TABLE store_meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)",
            "INSERT INTO store_meta VALUES ('store_id', lower(hex(randomblob(16))))",
        ),
    ),
    Migration(
        4,
        "live audio: the seconds of a running track's live audio, so any dispatcher shows them",
        ("ALTER TABLE tracks ADD COLUMN preview_sec REAL NOT NULL DEFAULT 0",),
    ),
    Migration(
        5,
        "webhooks and keys: the outbox of webhook events, each job's key name and last progress event",
        (
            "ALTER TABLE jobs ADD COLUMN caller TEXT",
            "ALTER TABLE jobs ADD COLUMN progress_event_at REAL NOT NULL DEFAULT 0",
            "CREATE INDEX jobs_caller ON jobs(caller, created_at)",
            V5_WEBHOOK_EVENTS,
            "CREATE INDEX webhook_events_due ON webhook_events(state, next_at)",
            "CREATE INDEX webhook_events_job ON webhook_events(job_id, id)",
        ),
    ),
    Migration(
        6,
        "uploads: a person's own audio, queued for encoding, then continued from (store/uploads.py)",
        (
            """CREATE TABLE uploads (
                upload_id TEXT PRIMARY KEY,
                created_at REAL NOT NULL,
                status TEXT NOT NULL,
                filename TEXT NOT NULL DEFAULT '',
                ext TEXT NOT NULL,
                bytes INTEGER NOT NULL,
                duration_sec REAL NOT NULL,
                frames INTEGER NOT NULL,
                source TEXT NOT NULL DEFAULT '{}',
                error TEXT,
                attempts INTEGER NOT NULL DEFAULT 0,
                owner TEXT,
                worker_id INTEGER NOT NULL DEFAULT -1,
                started_at REAL,
                finished_at REAL
            )""",
            "CREATE INDEX uploads_status ON uploads(status, created_at)",
        ),
    ),
    Migration(
        7,
        "the API key an upload came with: a key sees its own uploads only (keys.py)",
        ("ALTER TABLE uploads ADD COLUMN caller TEXT",),
    ),
    Migration(
        8,
        "uploaded adapters: a key's own LoRA adapters, sent to every worker (store/adapters.py)",
        (
            """CREATE TABLE adapters (
                name TEXT PRIMARY KEY,
                caller TEXT,
                bytes INTEGER NOT NULL,
                sha256 TEXT NOT NULL,
                rank INTEGER NOT NULL,
                targets TEXT NOT NULL DEFAULT '[]',
                created_at REAL NOT NULL
            )""",
            "CREATE INDEX adapters_caller ON adapters(caller)",
        ),
    ),
)
SCHEMA_VERSION = MIGRATIONS[-1].version


def user_version(db: sqlite3.Connection) -> int:
    """The schema version of the file ``db`` is open on."""
    return int(db.execute("PRAGMA user_version").fetchone()[0])
