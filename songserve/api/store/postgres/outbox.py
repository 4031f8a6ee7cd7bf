"""The PostgreSQL store's outbox connector (``store.outbox``): the webhook events' claims, tries and sweeps.

``PgOutbox``'s methods are the ``webhooks`` loop's calls. Claims lock the due rows with ``FOR UPDATE
SKIP LOCKED`` and lease them on the database's clock, so one dispatcher of a fleet sends each event
(the outbox's rules: ``store/outbox.py``). ``events_cte`` adds the insert of a state change's events
to that change's own statement in the jobs store (it runs only when the change does).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from songserve.api.store.outbox import Delivery, OutboxStats, WebhookEvent, delivery_from_row, event_columns
from songserve.api.store.postgres.conn import NOW, PgLanes

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


class PgOutbox:
    """``Outbox`` over the store's connections (``db``: the calling lane's pool)."""

    def __init__(self, db: PgLanes) -> None:
        self.db = db

    async def add_progress(self, event: WebhookEvent, min_gap: float) -> bool:
        cte, params = events_cte([event], "u")
        rows = await self.db.rows(
            f"WITH u AS (UPDATE jobs SET progress_event_at={NOW} WHERE job_id=%s AND NOT terminal"
            f" AND progress_event_at <= {NOW} - %s RETURNING job_id){cte} SELECT count(*) AS n FROM u",
            [event.job_id, min_gap, *params],
        )
        return bool(rows[0]["n"])

    async def claim(self, owner: str, limit: int, lease_sec: float) -> list[Delivery]:
        rows = await self.db.rows(
            f"WITH c AS (SELECT e.id {DUE} ORDER BY e.id LIMIT %s FOR UPDATE OF e SKIP LOCKED)"
            f" UPDATE webhook_events w SET lease_owner=%s, lease_until={NOW} + %s FROM c WHERE w.id = c.id"
            " RETURNING w.*",
            (limit, owner, lease_sec),
        )
        return sorted((delivery_from_row(r) for r in rows), key=lambda d: d.row)

    async def delivered(self, row: int) -> None:
        await self.db.rows(
            f"UPDATE webhook_events SET state='delivered', ended_at={NOW}, lease_owner=NULL, lease_until=0"
            " WHERE id=%s AND state='pending' RETURNING id",
            (row,),
        )

    async def failed(self, row: int, owner: str, error: str, retry_in: float | None) -> None:
        ended = "state='failed', ended_at=" + NOW if retry_in is None else f"next_at={NOW} + %s"
        await self.db.rows(
            f"UPDATE webhook_events SET {ended}, attempts=attempts+1, last_error=%s, lease_owner=NULL,"
            " lease_until=0 WHERE id=%s AND state='pending' AND lease_owner=%s RETURNING id",
            [*([] if retry_in is None else [retry_in]), error, row, owner],
        )

    async def release(self, owner: str) -> None:
        await self.db.rows(
            "UPDATE webhook_events SET lease_owner=NULL, lease_until=0 WHERE lease_owner=%s AND state='pending'"
            " RETURNING id",
            (owner,),
        )

    async def stats(self) -> OutboxStats:
        rows = await self.db.read(
            "SELECT count(*) AS n, min(created_at) AS oldest FROM webhook_events WHERE state='pending'"
        )
        return OutboxStats(int(rows[0]["n"]), rows[0]["oldest"])

    async def sweep(self, ended_before: float) -> int:
        rows = await self.db.rows(
            "WITH d AS (DELETE FROM webhook_events WHERE state <> 'pending' AND ended_at < %s RETURNING 1)"
            " SELECT count(*) AS n FROM d",
            (ended_before,),
        )
        return int(rows[0]["n"])
