"""A key's limits at submit, and its use as ``GET /usage`` answers it.

Two kinds of limit, two answers:
- a request's own size (``max_duration``, ``max_priority``, and a job of more tracks than
  ``tracks_per_hour`` allows in any hour): no wait would help, so 422 naming the request's field,
  as every other refused value (``check_request``);
- a rate or a count (``tracks_per_hour``, ``concurrent_jobs``): 429 with ``Retry-After`` (when the
  hour has room again, or an estimate for a job to end), its body naming the limit
  (``"limit": {"name", "value", "used"}``). The store counts and checks it in the insert's transaction
  (``store/quota.py``); ``OverLimit`` is its answer.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from songserve.api.service.keys import Caller
from songserve.api.store.protocol import JobStore
from songserve.api.store.quota import WINDOW_SEC, OverQuota, Quota, Usage, free_in
from songserve.errors import FieldError, SongserveError
from songserve.schemas import GenerateRequest, KeyLimits, UsageView

WORDS = {"tracks_per_hour": "tracks an hour", "concurrent_jobs": "unfinished jobs at once"}


class OverLimit(SongserveError):
    """A key over its hourly tracks or its concurrent jobs (HTTP 429, ``Retry-After``, ``limit`` in the body)."""

    http_status = 429

    def __init__(self, name: str, exc: OverQuota) -> None:
        retry = max(1, math.ceil(exc.retry_after))
        super().__init__(
            f"The key '{name}' is at its limit {exc.limit} ({exc.allowed} {WORDS.get(exc.limit, '')}, "
            f"{exc.used} used); try again in {retry} s."
        )
        self.headers = {"Retry-After": str(retry)}
        self.extra = {"limit": {"name": exc.limit, "value": exc.allowed, "used": exc.used}}


def _over(field: str, why: str, limit: str, value: float) -> FieldError:
    err = FieldError(field, why)
    err.extra = {"limit": {"name": limit, "value": value}}
    return err


def check_request(caller: Caller | None, req: GenerateRequest) -> None:
    """A request larger than its key allows: 422 naming the field and the limit."""
    if caller is None:
        return
    lim, who = caller.limits, f"the key '{caller.name}'"  # quoted, and never followed by a possessive 's
    if lim.max_duration is not None and req.duration > lim.max_duration:
        raise _over(
            "duration",
            f"{req.duration:g} minutes is over the max_duration of {who}, {lim.max_duration:g}",
            "max_duration",
            lim.max_duration,
        )
    if lim.max_priority is not None and req.priority > lim.max_priority:
        raise _over(
            "priority",
            f"{req.priority} is over the max_priority of {who}, {lim.max_priority}",
            "max_priority",
            lim.max_priority,
        )
    if lim.tracks_per_hour is not None and req.num_tracks > lim.tracks_per_hour:
        raise _over(
            "num_tracks",
            f"{req.num_tracks} tracks are more than the tracks_per_hour of {who}, "
            f"{lim.tracks_per_hour}, allows in any hour",
            "tracks_per_hour",
            lim.tracks_per_hour,
        )


def quota(caller: Caller | None, jobs_retry_sec: Callable[[], float]) -> Quota | None:
    """What the store checks for ``caller`` (None: no key, or no counted limit; ``jobs_retry_sec``, an
    estimate for the Retry-After of a key at its concurrent jobs, is asked only then)."""
    if caller is None or (caller.limits.tracks_per_hour is None and caller.limits.concurrent_jobs is None):
        return None
    lim = caller.limits
    return Quota(caller.name, lim.tracks_per_hour, lim.concurrent_jobs, max(1.0, jobs_retry_sec()))


def usage_view(caller: Caller | None, usage: Usage, now: float) -> UsageView:
    """``GET /usage``: the caller's limits and use (no key: the use of every job sent without one)."""
    lim = caller.limits if caller is not None else KeyLimits(upload_adapters=True)  # no keys: nothing is held back
    per_hour, jobs = lim.tracks_per_hour, lim.concurrent_jobs
    return UsageView(
        name=caller.name if caller is not None else None,
        limits=lim,
        tracks_last_hour=usage.tracks,
        active_jobs=usage.active_jobs,
        tracks_left=None if per_hour is None else max(0, per_hour - usage.tracks),
        jobs_left=None if jobs is None else max(0, jobs - usage.active_jobs),
        next_track_in_sec=0.0 if per_hour is None else round(free_in(usage.recent, per_hour, 1, now), 1),
    )


class UsageService:
    """``GET /usage``: a key's limits and its use, counted from the store (the whole fleet's)."""

    def __init__(self, store: JobStore) -> None:
        self.store = store

    async def view(self, caller: Caller | None) -> UsageView:
        now = time.time()
        return usage_view(caller, await self.store.usage(caller.name if caller else None, now - WINDOW_SEC), now)
