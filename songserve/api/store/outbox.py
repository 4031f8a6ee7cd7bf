"""The webhook outbox's records and rules: what both store engines keep, and when an event is tried again.

Why an outbox: a webhook must not be lost when a dispatcher dies between a job's state change and
its delivery, nor sent twice by two dispatchers of a fleet. So an event is a row of the job store
(``webhook_events``), written in the same transaction as the state change it reports (a track's
terminal state, a job's start and end; a ``progress`` row with the job's last-progress mark), and
delivered from there by the ``webhooks`` loop (``webhooks/sender.py``) of whichever dispatcher claims
it. An event row's life:

    pending ──claim (lease: owner, until)──▶ sending ──a 2xx answer──▶ delivered   (swept after an hour)
       ▲                                        │ refused, no answer, another status
       └── wait 4 s, 8 s, … ≤ 5 min ◀───────────┤   (while younger than WEBHOOK_MAX_AGE_SEC)
                                                └──────── older ──────────▶ failed  (swept after an hour)

"sending" is a pending row whose lease has not expired: a dispatcher killed while sending leaves a
lease that lapses, and the row is claimed again (at least once, with the same ``event_id``). Only
the oldest pending row of a job can be claimed, so a job's events arrive in the order they were
written, each after the one before it was delivered or given up.

``OutboxRepo`` keeps it over either engine's connector (``store.outbox``, the ``Outbox`` protocol
below; its SQL: ``store/queries/outbox.py``). Claims lock the due rows (``FOR UPDATE SKIP LOCKED`` on
PostgreSQL, the write lock on SQLite) and lease them on the store's clock, so one dispatcher of a
fleet sends each event. The events a state change reports are written by the jobs store in that
change's own transaction, with ``insert_events``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from songserve.api.store.connector import Connector, Tx
from songserve.api.store.queries import outbox as q

EVENT_KINDS = ("start", "progress", "track", "completed")
DEFAULT_EVENTS = ("completed",)
MAX_RETRY_SEC = 300.0  # the wait between tries doubles up to this
JITTER = 0.2  # each wait is cut by up to this share, so events that failed together do not retry together
PROGRESS_EVENT_SEC = 2.0  # at most one progress event per job in this time
SWEEP_AFTER_SEC = 3600.0  # delivered and given-up rows are kept this long (to look at), then removed


class OutboxState(StrEnum):
    pending = "pending"  # waiting for its next try, or being sent (leased)
    delivered = "delivered"
    failed = "failed"  # given up: no 2xx within WEBHOOK_MAX_AGE_SEC


@dataclass(frozen=True)
class WebhookEvent:
    """One event as written: its id (the ``webhook-id`` of every try), its job, kind, target and body."""

    event_id: str
    job_id: str
    kind: str
    url: str
    body: str  # the JSON text signed and sent, the same on every try
    created_at: float


@dataclass(frozen=True)
class Delivery:
    """A claimed event: the row's id, the event, and how many tries of it failed before this one."""

    row: int
    event: WebhookEvent
    attempts: int


@dataclass(frozen=True)
class OutboxStats:
    """Pending events in the store (the whole fleet's) and when the oldest was written (None: none)."""

    depth: int = 0
    oldest: float | None = None


def retry_delay(failures: int, base: float, draw: Callable[[], float] = random.random) -> float:
    """Seconds before the next try after ``failures`` failed ones: base, 2 × base, … up to 5 minutes,
    each less up to ``JITTER`` of it (``draw`` in [0, 1)): a receiver that was down for a while does
    not get every waiting event back in the same second, and no wait exceeds its bound."""
    return min(MAX_RETRY_SEC, base * 2.0 ** max(0, min(failures - 1, 30))) * (1.0 - JITTER * draw())


async def insert_events(tx: Tx, events: Sequence[WebhookEvent]) -> None:
    """Write ``events`` in the caller's transaction (that of the change they report)."""
    rows = [(e.event_id, e.job_id, e.kind, e.url, e.body, e.created_at) for e in events]
    await tx.execute_many(q.INSERT_EVENT, rows)


def delivery_from_row(r: Any) -> Delivery:
    """A ``Delivery`` from a ``webhook_events`` row (read by column name)."""
    event = WebhookEvent(r["event_id"], r["job_id"], r["kind"], r["url"], r["body"], float(r["created_at"]))
    return Delivery(int(r["id"]), event, int(r["attempts"]))


class Outbox(Protocol):
    """``JobStore.outbox``: the webhook events' claims, tries and sweeps (the ``webhooks`` loop's calls)."""

    async def add_progress(self, event: WebhookEvent, min_gap: float) -> bool:
        """Write a progress event unless the job has one from the last ``min_gap`` seconds or is finished."""

    async def claim(self, owner: str, limit: int, lease_sec: float) -> list[Delivery]:
        """Lease up to ``limit`` due events to ``owner``, each the oldest pending one of its job."""

    async def delivered(self, row: int) -> None: ...

    async def failed(self, row: int, owner: str, error: str, retry_in: float | None) -> None:
        """A failed try of ``owner``'s: tried again in ``retry_in`` seconds, or (None) given up."""

    async def release(self, owner: str) -> None:
        """``owner`` starts again: its leases on events end (nothing of it is sending any more)."""

    async def stats(self) -> OutboxStats: ...

    async def sweep(self, ended_before: float) -> int:
        """Remove delivered and given-up events that ended before ``ended_before``; returns how many."""


class OutboxRepo:
    """``Outbox`` over the store's connector."""

    def __init__(self, conn: Connector) -> None:
        self.conn = conn

    async def add_progress(self, event: WebhookEvent, min_gap: float) -> bool:
        async with self.conn.transaction() as tx:
            if await tx.execute(q.MARK_PROGRESS, (event.job_id, min_gap)) != 1:
                return False
            await insert_events(tx, [event])
        return True

    async def claim(self, owner: str, limit: int, lease_sec: float) -> list[Delivery]:
        if await self.conn.fetch_one(q.ANY_DUE) is None:
            return []  # the usual answer, without a write transaction
        async with self.conn.transaction() as tx:
            rows = await tx.fetch_all(q.CLAIM_DUE, (limit,))
            await tx.execute_many(q.LEASE, [(owner, lease_sec, r["id"]) for r in rows])
        return [delivery_from_row(r) for r in rows]

    async def delivered(self, row: int) -> None:
        await self.conn.execute(q.DELIVERED, (row,))

    async def failed(self, row: int, owner: str, error: str, retry_in: float | None) -> None:
        if retry_in is None:
            await self.conn.execute(q.GIVEN_UP, (error, row, owner))
        else:
            await self.conn.execute(q.RETRY, (retry_in, error, row, owner))

    async def release(self, owner: str) -> None:
        await self.conn.execute(q.RELEASE, (owner,))

    async def stats(self) -> OutboxStats:
        row = await self.conn.fetch_one(q.STATS)
        return OutboxStats(int(row["n"]), row["oldest"]) if row else OutboxStats()

    async def sweep(self, ended_before: float) -> int:
        return await self.conn.execute(q.SWEEP, (ended_before,))
