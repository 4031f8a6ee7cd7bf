"""A key's usage as the PostgreSQL store reads it, and its quota checked in the job insert's transaction.

``check_quota`` runs in the insert's transaction (``store/postgres/store.py``) under an advisory lock
per key name, so a fleet's dispatchers admit one key's jobs one at a time. The limits: ``store/quota.py``.
"""

from __future__ import annotations

from typing import Any

from songserve.api.store.postgres.conn import Conn
from songserve.api.store.quota import WINDOW_SEC, Quota, Usage, check

QUOTA_LOCK = 0x51_55_4F_54  # the first key of a quota's advisory lock ("QUOT"); the second is the name's hash
USAGE = (
    "SELECT (SELECT count(*) FROM jobs WHERE caller IS NOT DISTINCT FROM %s AND NOT terminal) AS active,"
    " COALESCE((SELECT json_agg(json_build_array(created_at, num_tracks) ORDER BY created_at) FROM jobs"
    " WHERE caller IS NOT DISTINCT FROM %s AND created_at > %s), '[]') AS recent"
)


def usage_from_row(row: dict[str, Any]) -> Usage:
    """A ``Usage`` from a row of ``USAGE`` (its parameters: the caller twice, then since when)."""
    return Usage(int(row["active"]), [(float(at), int(n)) for at, n in row["recent"]])


async def check_quota(conn: Conn, quota: Quota, wanted: int, now: float) -> None:
    """In the insert's transaction: wait for the key's lock, then raise ``OverQuota`` if over a limit."""
    await conn.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (QUOTA_LOCK, quota.caller))
    cur = await conn.execute(USAGE, (quota.caller, quota.caller, now - WINDOW_SEC))
    row = await cur.fetchone()
    check(quota, usage_from_row(row or {"active": 0, "recent": []}), wanted, now)
