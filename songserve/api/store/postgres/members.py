"""The PostgreSQL store's membership connector (``store.members``): the worker registry, live dispatchers
and worker leases (``store/members.py`` has the protocol).

Every time is the database's clock (``NOW``), so hosts' clocks need not agree.

A lease row (``workers``): ``lease_owner``, ``lease_until`` and ``lease_epoch``. The epoch grows by one
each time the lease is taken by anyone but the holder of an unexpired lease: when it changes hands,
and when it is re-taken after it expired (even by its last holder, who may have been paused and
cannot know what happened meanwhile). Track writes carry the epoch they were made under and the
store checks it in the same statement (``lease_cte``, which the jobs store's and the uploads
connector's statements include): that is the fence.
"""

from __future__ import annotations

from typing import Any

from songserve.api.store.members import Fence, WorkerRow
from songserve.api.store.postgres.conn import NOW, PgLanes


def lease_cte(fence: Fence | None) -> tuple[str, list[Any]]:
    """A CTE ``lease`` with one row while ``fence`` holds (none once it does not), and its parameters.

    ``FOR SHARE`` makes a lease change wait for the statement that checks it, and the check re-read the
    row a concurrent change just committed: a claim and a take-over never cross. No fence: one row."""
    if fence is None:
        return "lease AS MATERIALIZED (SELECT 1)", []
    return (
        "lease AS MATERIALIZED (SELECT worker_id FROM workers WHERE worker_id=%s AND lease_owner=%s"
        f" AND lease_epoch=%s AND lease_until > {NOW} FOR SHARE)",
        [fence.worker_id, fence.owner, fence.epoch],
    )


class PgMembers:
    """``MemberStore`` over the store's connections (``db``: the calling lane's pool)."""

    def __init__(self, db: PgLanes) -> None:
        self.db = db

    async def register(self, url: str, ttl: float, announced: bool) -> int:
        renew = (
            f"UPDATE workers SET registered_until=GREATEST(registered_until, {NOW} + %s), announced=%s"
            " WHERE url=%s RETURNING worker_id"
        )
        async with self.db.tx() as conn:
            row = await (await conn.execute(renew, (ttl, announced, url))).fetchone()  # the usual case: a renewal
            if row is None:  # a new URL: ids are handed out one registration at a time
                await conn.execute("LOCK TABLE workers IN SHARE ROW EXCLUSIVE MODE")
                row = await (await conn.execute(renew, (ttl, announced, url))).fetchone()
            if row is None:
                cur = await conn.execute(
                    "INSERT INTO workers (worker_id, url, announced, registered_until)"
                    f" SELECT COALESCE(MAX(worker_id) + 1, 0), %s, %s, {NOW} + %s FROM workers RETURNING worker_id",
                    (url, announced, ttl),
                )
                row = await cur.fetchone()
        return int(row["worker_id"])  # type: ignore[index]

    async def withdraw(self, worker_id: int) -> bool:
        rows = await self.db.rows(
            "UPDATE workers SET registered_until=0 WHERE worker_id=%s AND registered_until > 0 RETURNING worker_id",
            (worker_id,),
        )
        return bool(rows)

    async def live_workers(self) -> list[WorkerRow]:
        rows = await self.db.read(
            f"SELECT worker_id, url, announced, CASE WHEN lease_until > {NOW} THEN lease_owner END AS owner"
            f" FROM workers WHERE registered_until > {NOW} ORDER BY worker_id"
        )
        return [WorkerRow(int(r["worker_id"]), r["url"], bool(r["announced"]), r["owner"]) for r in rows]

    async def heartbeat(self, dispatcher_id: str, ttl: float) -> set[str]:
        async with self.db.tx() as conn:
            await conn.execute(
                f"INSERT INTO dispatchers VALUES (%s, {NOW} + %s)"
                " ON CONFLICT (dispatcher_id) DO UPDATE SET alive_until=EXCLUDED.alive_until",
                (dispatcher_id, ttl),
            )
            await conn.execute(f"DELETE FROM dispatchers WHERE alive_until < {NOW} - 3600")
            cur = await conn.execute(f"SELECT dispatcher_id FROM dispatchers WHERE alive_until > {NOW}")
            return {r["dispatcher_id"] for r in await cur.fetchall()}

    async def leave(self, dispatcher_id: str) -> None:
        async with self.db.tx() as conn:
            await conn.execute("DELETE FROM dispatchers WHERE dispatcher_id=%s", (dispatcher_id,))
            await conn.execute(
                "UPDATE workers SET lease_owner=NULL, lease_until=0 WHERE lease_owner=%s", (dispatcher_id,)
            )

    async def renew_leases(self, owner: str, ttl: float) -> dict[int, int]:
        rows = await self.db.rows(
            f"UPDATE workers SET lease_until={NOW} + %s WHERE lease_owner=%s AND lease_until > {NOW}"
            " RETURNING worker_id, lease_epoch",
            (ttl, owner),
        )
        return {int(r["worker_id"]): int(r["lease_epoch"]) for r in rows}

    async def acquire_lease(self, owner: str, worker_id: int, ttl: float) -> int | None:
        rows = await self.db.rows(
            "UPDATE workers SET lease_epoch = lease_epoch + (CASE WHEN lease_owner IS NOT DISTINCT FROM %s"
            f" AND lease_until > {NOW} THEN 0 ELSE 1 END), lease_owner=%s, lease_until={NOW} + %s"
            f" WHERE worker_id=%s AND registered_until > {NOW}"
            f" AND (lease_owner IS NULL OR lease_owner=%s OR lease_until <= {NOW}) RETURNING lease_epoch",
            (owner, owner, ttl, worker_id, owner),
        )
        return int(rows[0]["lease_epoch"]) if rows else None

    async def release_lease(self, owner: str, worker_id: int) -> None:
        await self.db.rows(
            "UPDATE workers SET lease_owner=NULL, lease_until=0 WHERE worker_id=%s AND lease_owner=%s RETURNING worker_id",
            (worker_id, owner),
        )
