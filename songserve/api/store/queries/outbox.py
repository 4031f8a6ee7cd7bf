"""The webhook outbox's SQL (``store/outbox.py`` has its rules)."""

INSERT_EVENT = "INSERT INTO webhook_events (event_id, job_id, kind, url, body, created_at) VALUES (?, ?, ?, ?, ?, ?)"

# The due events, each the oldest pending one of its job (so a job's events go out in order).
DUE = (
    "FROM webhook_events e WHERE state='pending' AND next_at <= {now} AND lease_until <= {now} AND NOT EXISTS"
    " (SELECT 1 FROM webhook_events p WHERE p.job_id = e.job_id AND p.state='pending' AND p.id < e.id)"
)
ANY_DUE = f"SELECT 1 AS due {DUE} LIMIT 1"
CLAIM_DUE = f"SELECT e.* {DUE} ORDER BY e.id LIMIT ?{{skip_locked}}"
LEASE = "UPDATE webhook_events SET lease_owner=?, lease_until={now} + ? WHERE id=?"

MARK_PROGRESS = (
    "UPDATE jobs SET progress_event_at={now} WHERE job_id=? AND NOT terminal AND progress_event_at <= {now} - ?"
)
DELIVERED = (
    "UPDATE webhook_events SET state='delivered', ended_at={now}, lease_owner=NULL, lease_until=0"
    " WHERE id=? AND state='pending'"
)
GIVEN_UP = (
    "UPDATE webhook_events SET state='failed', ended_at={now}, attempts=attempts+1, last_error=?,"
    " lease_owner=NULL, lease_until=0 WHERE id=? AND state='pending' AND lease_owner=?"
)
RETRY = (
    "UPDATE webhook_events SET next_at={now} + ?, attempts=attempts+1, last_error=?, lease_owner=NULL,"
    " lease_until=0 WHERE id=? AND state='pending' AND lease_owner=?"
)
RELEASE = "UPDATE webhook_events SET lease_owner=NULL, lease_until=0 WHERE lease_owner=? AND state='pending'"
STATS = "SELECT COUNT(*) AS n, MIN(created_at) AS oldest FROM webhook_events WHERE state='pending'"
SWEEP = "DELETE FROM webhook_events WHERE state <> 'pending' AND ended_at < ?"
