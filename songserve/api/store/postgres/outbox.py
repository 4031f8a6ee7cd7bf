"""The PostgreSQL store's webhook outbox and key usage: ``PgStore`` mixes these in.

Kept apart from the jobs and tracks (``store/postgres/store.py``). ``events_cte`` adds the insert of a state
change's events to that change's own statement (it runs only when the change does); ``check_quota``
runs in the job insert's transaction under an advisory lock per key name, so a fleet's dispatchers
admit one key's jobs one at a time. Claims lock the due rows with ``FOR UPDATE SKIP LOCKED`` and
lease them on the database's clock, so one dispatcher of a fleet sends each event (the outbox's
rules: ``store/outbox.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from songserve.api.store.outbox import Delivery, OutboxStats, WebhookEvent, delivery_from_row, event_columns
from songserve.api.store.postgres.conn import NOW, Conn, PgConnections
from songserve.api.store.quota import WINDOW_SEC, Quota, Usage, check

QUOTA_LOCK = 0x51_55_4F_54  # the first key of a quota's advisory lock ("QUOT"); the second is the name's hash
USAGE = (
    "SELECT (SELECT count(*) FROM jobs WHERE caller IS NOT DISTINCT FROM %s AND NOT terminal) AS active,"
    " COALESCE((SELECT json_agg(json_build_array(created_at, num_tracks) ORDER BY created_at) FROM jobs"
    " WHERE caller IS NOT DISTINCT FROM %s AND created_at > %s), '[]') AS recent"
)
DUE = (
    f"FROM webhook_events e WHERE state='pending' AND next_at <= {NOW} AND lease_until <= {NOW} AND NOT EXISTS"
    " (SELECT 1 FROM webhook_events p WHERE p.job_id = e.job_id AND p.state='pending' AND p.id < e.id)"
)


def events_cte(events: Sequence[WebhookEvent], gate: str) -> tuple[str, list[Any]]:
    """``, e AS (INSERT …)`` writing ``events`` when the CTE ``gate`` has a row, and its parameters;
    nothing at all without events (the statement of a job without a webhook is unchanged)."""
    if not events:
        return "", []
    return (
        ", e AS (INSERT INTO webhook_events (event_id, job_id, kind, url, body, created_at)"
        " SELECT * FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[], %s::text[], %s::float8[])"
        f" WHERE EXISTS (SELECT 1 FROM {gate}))",
        event_columns(list(events)),
    )


def _usage(row: dict[str, Any]) -> Usage:
    return Usage(int(row["active"]), [(float(at), int(n)) for at, n in row["recent"]])


async def check_quota(conn: Conn, quota: Quota, wanted: int, now: float) -> None:
    """In the insert's transaction: wait for the key's lock, then raise ``OverQuota`` if over a limit."""
    await conn.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (QUOTA_LOCK, quota.caller))
    cur = await conn.execute(USAGE, (quota.caller, quota.caller, now - WINDOW_SEC))
    row = await cur.fetchone()
    check(quota, _usage(row or {"active": 0, "recent": []}), wanted, now)


class PgOutbox:
    """``JobStore``'s outbox and usage methods over ``db`` (the store's connections)."""

    @property
    def db(self) -> PgConnections:
        raise NotImplementedError  # PgStore: the pool of the calling lane

    async def usage(self, caller: str | None, since: float) -> Usage:
        return _usage((await self.db.read(USAGE, (caller, caller, since)))[0])

    async def add_progress_event(self, event: WebhookEvent, min_gap: float) -> bool:
        cte, params = events_cte([event], "u")
        rows = await self.db.rows(
            f"WITH u AS (UPDATE jobs SET progress_event_at={NOW} WHERE job_id=%s AND NOT terminal"
            f" AND progress_event_at <= {NOW} - %s RETURNING job_id){cte} SELECT count(*) AS n FROM u",
            [event.job_id, min_gap, *params],
        )
        return bool(rows[0]["n"])

    async def claim_events(self, owner: str, limit: int, lease_sec: float) -> list[Delivery]:
        rows = await self.db.rows(
            f"WITH c AS (SELECT e.id {DUE} ORDER BY e.id LIMIT %s FOR UPDATE OF e SKIP LOCKED)"
            f" UPDATE webhook_events w SET lease_owner=%s, lease_until={NOW} + %s FROM c WHERE w.id = c.id"
            " RETURNING w.*",
            (limit, owner, lease_sec),
        )
        return sorted((delivery_from_row(r) for r in rows), key=lambda d: d.row)

    async def event_delivered(self, row: int) -> None:
        await self.db.rows(
            f"UPDATE webhook_events SET state='delivered', ended_at={NOW}, lease_owner=NULL, lease_until=0"
            " WHERE id=%s AND state='pending' RETURNING id",
            (row,),
        )

    async def event_failed(self, row: int, owner: str, error: str, retry_in: float | None) -> None:
        ended = "state='failed', ended_at=" + NOW if retry_in is None else f"next_at={NOW} + %s"
        await self.db.rows(
            f"UPDATE webhook_events SET {ended}, attempts=attempts+1, last_error=%s, lease_owner=NULL,"
            " lease_until=0 WHERE id=%s AND state='pending' AND lease_owner=%s RETURNING id",
            [*([] if retry_in is None else [retry_in]), error, row, owner],
        )

    async def release_events(self, owner: str) -> None:
        await self.db.rows(
            "UPDATE webhook_events SET lease_owner=NULL, lease_until=0 WHERE lease_owner=%s AND state='pending'"
            " RETURNING id",
            (owner,),
        )

    async def outbox_stats(self) -> OutboxStats:
        rows = await self.db.read(
            "SELECT count(*) AS n, min(created_at) AS oldest FROM webhook_events WHERE state='pending'"
        )
        return OutboxStats(int(rows[0]["n"]), rows[0]["oldest"])

    async def sweep_events(self, ended_before: float) -> int:
        rows = await self.db.rows(
            "WITH d AS (DELETE FROM webhook_events WHERE state <> 'pending' AND ended_at < %s RETURNING 1)"
            " SELECT count(*) AS n FROM d",
            (ended_before,),
        )
        return int(rows[0]["n"])
