"""The job store's membership: the worker registry, the live dispatchers and the workers' leases.

Why in the store: a fleet of dispatchers shares one set of workers, so who is alive and which of them
may send a worker tasks now must be one answer for all of them, and survive any one's restart. Each
engine keeps it in a small connector of its own (``store.members``: ``store/sqlite/members.py``,
``store/postgres/members.py``); the dispatcher's side is ``dispatch/membership.py``.

A lease (a ``workers`` row's ``lease_owner``, ``lease_until``, ``lease_epoch``) names the one
dispatcher that may send the worker tasks until it expires. Its epoch grows each time the lease is
taken by anyone but the holder of an unexpired lease, and every write for a track or an upload on
that worker carries the ``Fence`` it was made under, checked by the engine in the write's own
transaction: a dispatcher paused past its lease cannot write under it afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


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
