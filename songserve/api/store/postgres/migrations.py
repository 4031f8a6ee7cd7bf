"""The PostgreSQL job store's schema steps, in PostgreSQL's SQL (the same numbered versions as SQLite's).

The steps are run by the store's one runner (``store/migrations.py``), each in one transaction with
its version bump (a row of ``songserve_schema``) under the schema's advisory lock, so when several
dispatchers, perhaps of different builds, start against one database, one migrates and the others wait.
"""

from __future__ import annotations

from songserve.api.store.migrations import Migration

MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "jobs and tracks",
        (
            """CREATE TABLE jobs (
                job_id TEXT PRIMARY KEY,
                seq BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE,
                created_at DOUBLE PRECISION NOT NULL,
                started_at DOUBLE PRECISION,
                finished_at DOUBLE PRECISION,
                cancelled BOOLEAN NOT NULL DEFAULT false,
                priority INTEGER NOT NULL DEFAULT 0,
                request TEXT NOT NULL,
                cleaned_lyrics TEXT NOT NULL,
                num_tracks INTEGER NOT NULL,
                idempotency_key TEXT UNIQUE,
                terminal BOOLEAN NOT NULL DEFAULT false
            )""",
            """CREATE TABLE tracks (
                job_id TEXT NOT NULL REFERENCES jobs(job_id) ON DELETE CASCADE,
                idx INTEGER NOT NULL,
                status TEXT NOT NULL,
                seed BIGINT NOT NULL,
                attempts INTEGER NOT NULL DEFAULT 0,
                worker_id INTEGER NOT NULL DEFAULT -1,
                task_id TEXT,
                error TEXT,
                duration_sec DOUBLE PRECISION NOT NULL DEFAULT 0,
                started_at DOUBLE PRECISION,
                finished_at DOUBLE PRECISION,
                metadata TEXT NOT NULL DEFAULT '{}',
                PRIMARY KEY (job_id, idx)
            )""",
            "CREATE INDEX jobs_terminal ON jobs(terminal, finished_at)",
            "CREATE INDEX tracks_status ON tracks(status)",
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
            "ALTER TABLE tracks ADD COLUMN phase_rate DOUBLE PRECISION",
            "CREATE INDEX tracks_worker ON tracks(worker_id, status)",
            """CREATE TABLE workers (
                worker_id INTEGER PRIMARY KEY,
                url TEXT NOT NULL UNIQUE,
                announced BOOLEAN NOT NULL DEFAULT false,
                registered_until DOUBLE PRECISION NOT NULL,
                lease_owner TEXT,
                lease_until DOUBLE PRECISION NOT NULL DEFAULT 0
            )""",
            "CREATE TABLE dispatchers (dispatcher_id TEXT PRIMARY KEY, alive_until DOUBLE PRECISION NOT NULL)",
        ),
    ),
    Migration(
        3,
        "fencing: a lease epoch per worker, and the store's own id (the epochs' namespace on a worker)",
        (
            "ALTER TABLE workers ADD COLUMN lease_epoch BIGINT NOT NULL DEFAULT 0",
            "CREATE TABLE store_meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)",
            "INSERT INTO store_meta VALUES ('store_id', md5(random()::text || clock_timestamp()::text))",
        ),
    ),
    Migration(
        4,
        "live audio: the seconds of a running track's live audio, so any dispatcher shows them",
        ("ALTER TABLE tracks ADD COLUMN preview_sec DOUBLE PRECISION NOT NULL DEFAULT 0",),
    ),
    Migration(
        5,
        "webhooks and keys: the outbox of webhook events, each job's key name and last progress event",
        (
            "ALTER TABLE jobs ADD COLUMN caller TEXT",
            "ALTER TABLE jobs ADD COLUMN progress_event_at DOUBLE PRECISION NOT NULL DEFAULT 0",
            "CREATE INDEX jobs_caller ON jobs(caller, created_at)",
            """CREATE TABLE webhook_events (
                id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                event_id TEXT NOT NULL UNIQUE,
                job_id TEXT NOT NULL,
                kind TEXT NOT NULL,
                url TEXT NOT NULL,
                body TEXT NOT NULL,
                created_at DOUBLE PRECISION NOT NULL,
                state TEXT NOT NULL DEFAULT 'pending',
                attempts INTEGER NOT NULL DEFAULT 0,
                next_at DOUBLE PRECISION NOT NULL DEFAULT 0,
                lease_owner TEXT,
                lease_until DOUBLE PRECISION NOT NULL DEFAULT 0,
                last_error TEXT,
                ended_at DOUBLE PRECISION
            )""",
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
                created_at DOUBLE PRECISION NOT NULL,
                status TEXT NOT NULL,
                filename TEXT NOT NULL DEFAULT '',
                ext TEXT NOT NULL,
                bytes BIGINT NOT NULL,
                duration_sec DOUBLE PRECISION NOT NULL,
                frames INTEGER NOT NULL,
                source TEXT NOT NULL DEFAULT '{}',
                error TEXT,
                attempts INTEGER NOT NULL DEFAULT 0,
                owner TEXT,
                worker_id INTEGER NOT NULL DEFAULT -1,
                started_at DOUBLE PRECISION,
                finished_at DOUBLE PRECISION
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
                bytes BIGINT NOT NULL,
                sha256 TEXT NOT NULL,
                rank INTEGER NOT NULL,
                targets TEXT NOT NULL DEFAULT '[]',
                created_at DOUBLE PRECISION NOT NULL
            )""",
            "CREATE INDEX adapters_caller ON adapters(caller)",
        ),
    ),
)
SCHEMA_VERSION = MIGRATIONS[-1].version
