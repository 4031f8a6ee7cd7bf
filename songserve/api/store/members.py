"""The job store's membership: the worker registry, the live dispatchers and the workers' leases.

Why in the store: a fleet of dispatchers shares one set of workers, so who is alive and which of them
may send a worker tasks now must be one answer for all of them, and survive any one's restart.
``Members`` keeps it over either engine's connector (``store.members``; its SQL:
``store/queries/members.py``); the dispatcher's side is ``dispatch/membership.py``. Times are the
store's clock (the database's on PostgreSQL), so hosts' clocks need not agree.

A lease (a ``workers`` row's ``lease_owner``, ``lease_until``, ``lease_epoch``) names the one
dispatcher that may send the worker tasks until it expires. Its epoch grows each time the lease is
taken by anyone but the holder of an unexpired lease, and every write for a track or an upload on
that worker carries the ``Fence`` it was made under, checked by the engine in the write's own
transaction (``holds``): a dispatcher paused past its lease cannot write under it afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from songserve.api.store.connector import Connector, Tx
from songserve.api.store.queries import members as q


@dataclass(frozen=True)
class WorkerRow:
    """A worker in the shared registry: configured on a dispatcher (static) or announced by itself."""

    worker_id: int
    url: str
    announced: bool
    lease_owner: str | None  # the dispatcher that may send it tasks now (None: free or expired)


@dataclass(frozen=True)
class Fence:
    """The lease a write is made under: ``owner`` holds ``worker_id``'s lease at ``epoch``."""

    owner: str
    worker_id: int
    epoch: int

    def __str__(self) -> str:
        return f"worker {self.worker_id} lease epoch {self.epoch}"


class MemberStore(Protocol):
    """``JobStore.members``: workers, dispatchers and leases (every method one short transaction)."""

    async def register(self, url: str, ttl: float, announced: bool) -> int:
        """Add or renew a worker's registration for ``ttl`` seconds; returns its id (stable per URL)."""

    async def withdraw(self, worker_id: int) -> bool:
        """End a worker's registration now; whether it was registered."""

    async def live_workers(self) -> list[WorkerRow]: ...

    async def heartbeat(self, dispatcher_id: str, ttl: float) -> set[str]:
        """Renew this dispatcher's presence; returns the ids of the live dispatchers (itself included)."""

    async def leave(self, dispatcher_id: str) -> None:
        """This dispatcher stops: its presence and its leases end now."""

    async def renew_leases(self, owner: str, ttl: float) -> dict[int, int]:
        """Extend the leases ``owner`` still holds (unexpired); returns worker id → lease epoch."""

    async def acquire_lease(self, owner: str, worker_id: int, ttl: float) -> int | None:
        """Take the worker's lease if it is free, expired or already ours; returns its epoch (≥ 1),
        one higher than before unless ``owner`` held it unexpired, or None when another holds it."""

    async def release_lease(self, owner: str, worker_id: int) -> None: ...


async def holds(tx: Tx, fence: Fence) -> bool:
    """In the caller's transaction: the fence's lease row says what the fence says, and has not expired."""
    return await tx.fetch_one(q.HOLDS, (fence.worker_id, fence.owner, fence.epoch)) is not None


class Members:
    """``MemberStore`` over the store's connector."""

    def __init__(self, conn: Connector) -> None:
        self.conn = conn

    async def register(self, url: str, ttl: float, announced: bool) -> int:
        async with self.conn.transaction() as tx:
            row = await tx.fetch_one(q.RENEW_WORKER, (ttl, announced, url))  # the usual case: a renewal
            if row is None:  # a new URL: ids are handed out one registration at a time
                await tx.lock(q.REGISTRATION_LOCK)
                row = await tx.fetch_one(q.RENEW_WORKER, (ttl, announced, url))
            if row is None:
                row = await tx.fetch_one(q.INSERT_WORKER, (url, announced, ttl))
        assert row is not None  # an INSERT … RETURNING returns its row
        return int(row["worker_id"])

    async def withdraw(self, worker_id: int) -> bool:
        return await self.conn.execute(q.WITHDRAW, (worker_id,)) == 1

    async def live_workers(self) -> list[WorkerRow]:
        rows = await self.conn.fetch_all(q.LIVE_WORKERS)
        return [WorkerRow(int(r["worker_id"]), r["url"], bool(r["announced"]), r["owner"]) for r in rows]

    async def heartbeat(self, dispatcher_id: str, ttl: float) -> set[str]:
        async with self.conn.transaction() as tx:
            await tx.execute(q.HEARTBEAT, (dispatcher_id, ttl))
            await tx.execute(q.FORGET_DISPATCHERS)
            return {r["dispatcher_id"] for r in await tx.fetch_all(q.LIVE_DISPATCHERS)}

    async def leave(self, dispatcher_id: str) -> None:
        async with self.conn.transaction() as tx:
            await tx.execute(q.LEAVE, (dispatcher_id,))
            await tx.execute(q.DROP_LEASES, (dispatcher_id,))

    async def renew_leases(self, owner: str, ttl: float) -> dict[int, int]:
        async with self.conn.transaction() as tx:
            rows = await tx.fetch_all(q.RENEW_LEASES, (ttl, owner))
        return {int(r["worker_id"]): int(r["lease_epoch"]) for r in rows}

    async def acquire_lease(self, owner: str, worker_id: int, ttl: float) -> int | None:
        async with self.conn.transaction() as tx:
            row = await tx.fetch_one(q.ACQUIRE_LEASE, (owner, owner, ttl, worker_id, owner))
        return int(row["lease_epoch"]) if row else None

    async def release_lease(self, owner: str, worker_id: int) -> None:
        await self.conn.execute(q.RELEASE_LEASE, (worker_id, owner))
