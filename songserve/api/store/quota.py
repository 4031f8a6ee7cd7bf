"""A key's quota as the job store checks it: tracks in the last hour and jobs not yet finished.

Why in the store: the count must be right across a dispatcher's restart and across a fleet, so it
is read from the stored jobs (each carries its key's name, ``jobs.caller``), and checked in the same
transaction as the insert of the job it admits (SQLite's write lock; on PostgreSQL an advisory lock
per key name), so two submissions at two dispatchers cannot both take the last track: the jobs store
calls ``check_quota`` in its insert's transaction, which raises ``OverQuota`` naming the limit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from songserve.api.store.connector import Reader, Tx
from songserve.api.store.queries import quota as q

WINDOW_SEC = 3600.0  # tracks_per_hour counts the tracks submitted in the last hour (a sliding window)


@dataclass(frozen=True)
class Quota:
    """The store's part of a key's limits (None: unlimited)."""

    caller: str
    tracks_per_hour: int | None = None
    concurrent_jobs: int | None = None
    jobs_retry_sec: float = 10.0  # the Retry-After for a key at its concurrent jobs (an estimate)

    @property
    def limited(self) -> bool:
        return self.tracks_per_hour is not None or self.concurrent_jobs is not None


@dataclass(frozen=True)
class Usage:
    """A key name's use as stored: its unfinished jobs and (submitted at, tracks) of the last hour's jobs."""

    active_jobs: int
    recent: Sequence[tuple[float, int]]  # oldest first

    @property
    def tracks(self) -> int:
        return sum(n for _, n in self.recent)


class OverQuota(Exception):
    """A job the key's quota does not admit now: which limit, its value, what is used, and when to try again."""

    def __init__(self, limit: str, allowed: int, used: int, retry_after: float) -> None:
        super().__init__(f"{limit}: {used} of {allowed} used")
        self.limit, self.allowed, self.used, self.retry_after = limit, allowed, used, retry_after


def free_in(recent: Sequence[tuple[float, int]], allowed: int, wanted: int, now: float) -> float:
    """Seconds until ``wanted`` more tracks fit under ``allowed`` in the window (0: they fit now)."""
    used = sum(n for _, n in recent)
    if used + wanted <= allowed:
        return 0.0
    for at, n in recent:  # oldest first: each leaves the window an hour after it was submitted
        used -= n
        if used + wanted <= allowed:
            return max(0.0, at + WINDOW_SEC - now)
    return WINDOW_SEC  # more than the limit at once: refused before the store is asked (usage.py)


def check(quota: Quota, usage: Usage, wanted: int, now: float) -> None:
    """Raise ``OverQuota`` when a job of ``wanted`` tracks is over one of ``quota``'s limits now."""
    if quota.concurrent_jobs is not None and usage.active_jobs >= quota.concurrent_jobs:
        raise OverQuota("concurrent_jobs", quota.concurrent_jobs, usage.active_jobs, quota.jobs_retry_sec)
    if quota.tracks_per_hour is not None and usage.tracks + wanted > quota.tracks_per_hour:
        wait = free_in(usage.recent, quota.tracks_per_hour, wanted, now)
        raise OverQuota("tracks_per_hour", quota.tracks_per_hour, usage.tracks, wait)


async def read_usage(db: Reader, caller: str | None, since: float) -> Usage:
    """A key name's unfinished jobs, and (submitted at, tracks) of its jobs since ``since``, oldest first."""
    active = await db.fetch_one(q.ACTIVE, (caller,))
    recent = await db.fetch_all(q.RECENT, (caller, since))
    return Usage(int(active["n"]) if active else 0, [(float(r["created_at"]), int(r["num_tracks"])) for r in recent])


async def check_quota(tx: Tx, quota: Quota, wanted: int, now: float) -> None:
    """In the insert's transaction, under the key's lock: raise ``OverQuota`` if the job is over a limit."""
    await tx.lock(q.QUOTA_LOCK, quota.caller)
    check(quota, await read_usage(tx, quota.caller, now - WINDOW_SEC), wanted, now)
