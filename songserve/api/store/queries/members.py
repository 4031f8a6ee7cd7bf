"""The membership's SQL: the worker registry, live dispatchers, leases and the fence check (``store/members.py``)."""

# In the caller's transaction: the fence's lease row says what the fence says and has not expired. On
# PostgreSQL ``FOR SHARE`` makes a lease change wait for the transaction that checked it, and the check
# re-read a row a concurrent change just committed: a write and a take-over never cross.
HOLDS = (
    "SELECT 1 AS held FROM workers WHERE worker_id=? AND lease_owner=? AND lease_epoch=? AND lease_until > {now}"
    "{for_share}"
)

RENEW_WORKER = (
    "UPDATE workers SET registered_until={greatest}(registered_until, {now} + ?), announced=? WHERE url=?"
    " RETURNING worker_id"
)
INSERT_WORKER = (
    "INSERT INTO workers (worker_id, url, announced, registered_until)"
    " SELECT COALESCE(MAX(worker_id) + 1, 0), ?, ?, {now} + ? FROM workers RETURNING worker_id"
)
REGISTRATION_LOCK = 0x52_45_47_49  # registrations hand out ids one at a time ("REGI")
WITHDRAW = "UPDATE workers SET registered_until=0 WHERE worker_id=? AND registered_until > 0"
LIVE_WORKERS = (
    "SELECT worker_id, url, announced, CASE WHEN lease_until > {now} THEN lease_owner END AS owner"
    " FROM workers WHERE registered_until > {now} ORDER BY worker_id"
)

HEARTBEAT = (
    "INSERT INTO dispatchers VALUES (?, {now} + ?)"
    " ON CONFLICT (dispatcher_id) DO UPDATE SET alive_until=excluded.alive_until"
)
FORGET_DISPATCHERS = "DELETE FROM dispatchers WHERE alive_until < {now} - 3600"
LIVE_DISPATCHERS = "SELECT dispatcher_id FROM dispatchers WHERE alive_until > {now}"
LEAVE = "DELETE FROM dispatchers WHERE dispatcher_id=?"
DROP_LEASES = "UPDATE workers SET lease_owner=NULL, lease_until=0 WHERE lease_owner=?"

RENEW_LEASES = (
    "UPDATE workers SET lease_until={now} + ? WHERE lease_owner=? AND lease_until > {now}"
    " RETURNING worker_id, lease_epoch"
)
# The epoch stays only for a renewal by the holder of an unexpired lease.
ACQUIRE_LEASE = (
    "UPDATE workers SET lease_epoch = lease_epoch + (CASE WHEN lease_owner IS NOT DISTINCT FROM ?"
    " AND lease_until > {now} THEN 0 ELSE 1 END), lease_owner=?, lease_until={now} + ?"
    " WHERE worker_id=? AND registered_until > {now}"
    " AND (lease_owner IS NULL OR lease_owner=? OR lease_until <= {now}) RETURNING lease_epoch"
)
RELEASE_LEASE = "UPDATE workers SET lease_owner=NULL, lease_until=0 WHERE worker_id=? AND lease_owner=?"
