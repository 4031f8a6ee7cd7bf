"""The uploads' SQL (``store/uploads.py`` has the rules)."""

from songserve.api.store.connector import marks

UPLOAD_COLUMNS = (
    "upload_id",
    "created_at",
    "status",
    "filename",
    "ext",
    "bytes",
    "duration_sec",
    "frames",
    "source",
    "error",
    "attempts",
    "owner",
    "worker_id",
    "started_at",
    "finished_at",
    "caller",
)
FINISHED = "status IN ('ready', 'failed')"

INSERT = f"INSERT INTO uploads ({', '.join(UPLOAD_COLUMNS)}) VALUES ({marks(len(UPLOAD_COLUMNS))})"
LOAD = "SELECT * FROM uploads WHERE upload_id=?"
QUEUED = "SELECT * FROM uploads WHERE status='queued' ORDER BY created_at LIMIT ?"
# A claim locks the row (skipping one another dispatcher is claiming) after the fence's check.
LOCK_QUEUED = "SELECT upload_id FROM uploads WHERE upload_id=? AND status='queued'{skip_locked}"
CLAIM = (
    "UPDATE uploads SET status='encoding', owner=?, worker_id=?, attempts=attempts+1, started_at={now}"
    " WHERE upload_id=? AND status='queued'"
)
FINISH = (
    "UPDATE uploads SET status=?, frames=?, error=?, owner=NULL, finished_at=?"
    " WHERE upload_id=? AND status='encoding' AND owner=?"
)
REQUEUE = (
    "UPDATE uploads SET status='queued', owner=NULL, worker_id=-1, error=?, attempts=attempts-?"
    " WHERE upload_id=? AND status='encoding' AND owner=?"
)
ENCODING = "SELECT upload_id, owner FROM uploads WHERE status='encoding'{skip_locked}"
REQUEUE_STALE = "UPDATE uploads SET status='queued', owner=NULL, worker_id=-1 WHERE upload_id=? AND status='encoding'"
DELETE = "DELETE FROM uploads WHERE upload_id=?"
EXPIRED = f"SELECT upload_id FROM uploads WHERE {FINISHED} AND finished_at < ? ORDER BY finished_at"
FINISHED_OLDEST_FIRST = (
    "SELECT 'job' AS kind, job_id AS id, finished_at FROM jobs WHERE terminal UNION ALL"
    f" SELECT 'upload', upload_id, finished_at FROM uploads WHERE {FINISHED} ORDER BY finished_at"
)
IDS = "SELECT upload_id FROM uploads"
COUNTS = "SELECT status, COUNT(*) AS n FROM uploads GROUP BY status"
