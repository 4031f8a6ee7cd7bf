"""The jobs' and tracks' SQL (``store/jobs.py``; the rules: ``store/protocol.py``)."""

from songserve.api.jobs.states import RUNNING, TERMINAL
from songserve.api.store.protocol import STORED_TRACK_FIELDS

TERMINAL_SQL = ", ".join(f"'{s.value}'" for s in sorted(TERMINAL))
RUNNING_SQL = ", ".join(f"'{s.value}'" for s in sorted(RUNNING))
JOB_COLUMNS = "job_id, created_at, priority, request, cleaned_lyrics, num_tracks, idempotency_key, caller"

# A job's sequence: PostgreSQL's identity column; SQLite counts on under its write lock.
INSERT_JOB = {
    "sqlite": f"INSERT INTO jobs (seq, {JOB_COLUMNS}) SELECT COALESCE(MAX(seq), 0) + 1, ?, ?, ?, ?, ?, ?, ?, ?"
    " FROM jobs RETURNING seq",
    "postgresql": f"INSERT INTO jobs ({JOB_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?) RETURNING seq",
}
INSERT_TRACK = "INSERT INTO tracks (job_id, idx, status, seed) VALUES (?, ?, ?, ?)"
BY_KEY = "SELECT job_id FROM jobs WHERE idempotency_key=?"

# Compare-and-set: the row is written only while its (status, owner) are what the writer last saw.
WRITE_TRACK = (
    f"UPDATE tracks SET {', '.join(f + '=?' for f in STORED_TRACK_FIELDS)}"
    " WHERE job_id=? AND idx=? AND status=? AND owner IS NOT DISTINCT FROM ?"
)
# A claim locks the wanted rows still queued, skipping those another dispatcher is claiming.
LOCK_QUEUED = "SELECT idx FROM tracks WHERE job_id=? AND status='queued' AND idx IN ({indices}){skip_locked}"
SAVE_PROGRESS = (
    "UPDATE tracks SET worker_phase=?, phase_progress=?, phase_detail=?, phase_rate=?, preview_sec=?"
    " WHERE job_id=? AND idx=? AND owner IS NOT DISTINCT FROM ?"
)

MARK_STARTED = "UPDATE jobs SET started_at=? WHERE job_id=? AND started_at IS NULL"
MARK_CANCELLED = "UPDATE jobs SET cancelled=TRUE WHERE job_id=?"
FINISH = (
    "UPDATE jobs SET terminal=TRUE, finished_at=COALESCE(finished_at, ?) WHERE job_id=? AND NOT terminal"
    f" AND NOT EXISTS (SELECT 1 FROM tracks WHERE job_id=? AND status NOT IN ({TERMINAL_SQL}))"
)
IS_TERMINAL = "SELECT terminal FROM jobs WHERE job_id=?"
IS_CANCELLED = "SELECT cancelled FROM jobs WHERE job_id=?"
DELETE = "DELETE FROM jobs WHERE job_id=?"

JOB = "SELECT * FROM jobs WHERE job_id=?"
JOB_TRACKS = "SELECT * FROM tracks WHERE job_id=? ORDER BY idx"
ACTIVE = "SELECT * FROM jobs WHERE NOT terminal ORDER BY seq"
ACTIVE_TRACKS = "SELECT t.* FROM tracks t JOIN jobs j USING (job_id) WHERE NOT j.terminal ORDER BY t.job_id, t.idx"
RUNNING_ON = f"SELECT job_id, idx FROM tracks WHERE worker_id=? AND status IN ({RUNNING_SQL})"
EXPIRED = "SELECT job_id FROM jobs WHERE terminal AND finished_at < ? ORDER BY finished_at"
FINISHED_OLDEST_FIRST = "SELECT job_id FROM jobs WHERE terminal ORDER BY finished_at"
IDS = "SELECT job_id FROM jobs"
NEWEST_FIRST = "SELECT job_id, seq FROM jobs{where} ORDER BY seq DESC LIMIT ?"
COUNTS = "SELECT status, COUNT(*) AS n FROM tracks GROUP BY status"
WORK_RATIOS = (
    "SELECT metadata, started_at, finished_at, duration_sec FROM tracks WHERE status='done'"
    " AND duration_sec > 0 ORDER BY finished_at DESC LIMIT ?"
)
