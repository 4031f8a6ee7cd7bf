"""The webhook events a job's state changes make: which ones it asked for, and each one's body.

The track book asks here for the events of a change before it writes the change, and hands them to
the store with it (one transaction: ``store/outbox.py``): ``start`` when the job's first track starts,
``track`` when a track ends (done, error or cancelled), ``completed`` when the job is finished (every
track ended, whatever its status), ``progress`` when a running track moved (the store keeps it to
one per job per ``PROGRESS_EVENT_SEC``; this dispatcher does not even ask more often). A job without
a webhook, or one that did not ask for the kind, makes none, at no cost.

The body is the job view as it is after the change, in the Standard Webhooks shape:
``{"type": kind, "timestamp": ISO 8601, "data": <job view>}`` (and ``"track": i`` for a track event).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import time
from collections.abc import Mapping
from datetime import UTC, datetime

from songserve.api.jobs.records import Job, Key, Track
from songserve.api.jobs.views import job_view
from songserve.api.store.outbox import DEFAULT_EVENTS, PROGRESS_EVENT_SEC, WebhookEvent

MAX_THROTTLED = 10_000  # jobs remembered for the progress throttle before the stale ones are dropped


def wanted(job: Job, kind: str) -> bool:
    """Whether ``job`` asked for events of ``kind``."""
    r = job.request
    return bool(r.webhook) and kind in (r.webhook_events or DEFAULT_EVENTS)


class JobEvents:
    """Builds a job's events; ``new`` is set for each, so the webhooks loop looks at the outbox soon."""

    def __init__(self) -> None:
        self.new = asyncio.Event()
        self._progress_asked: dict[str, float] = {}  # job id → when this dispatcher last asked (monotonic)

    def of(
        self, job: Job | None, kind: str, track: Track | None = None, positions: Mapping[Key, int] | None = None
    ) -> list[WebhookEvent]:
        """The events of ``kind`` for ``job`` (with ``track``, the track's new state, in its view;
        ``positions``: the queue's, for the view of a job with queued tracks)."""
        if job is None or not wanted(job, kind):
            return []
        if track is not None:
            job = dataclasses.replace(job, tracks=[track if t.index == track.index else t for t in job.tracks])
        now = time.time()
        body: dict[str, object] = {"type": kind, "timestamp": datetime.fromtimestamp(now, UTC).isoformat()}
        if kind == "track" and track is not None:
            body["track"] = track.index
        body["data"] = job_view(job, positions or {}, None).model_dump(mode="json")
        self.new.set()
        url = str(job.request.webhook)
        return [WebhookEvent(f"evt_{secrets.token_hex(12)}", job.job_id, kind, url, json.dumps(body), now)]

    def progress_due(self, job: Job) -> bool:
        """Whether to ask the store for a progress event of ``job`` now (it decides for the fleet)."""
        if not wanted(job, "progress"):
            return False
        now = time.monotonic()
        if now - self._progress_asked.get(job.job_id, float("-inf")) < PROGRESS_EVENT_SEC:
            return False
        if len(self._progress_asked) >= MAX_THROTTLED:  # jobs another dispatcher finished: never forgotten here
            self._progress_asked = {j: t for j, t in self._progress_asked.items() if now - t < PROGRESS_EVENT_SEC}
        self._progress_asked[job.job_id] = now
        return True

    def forget(self, job_id: str) -> None:
        """The job finished: nothing more to throttle."""
        self._progress_asked.pop(job_id, None)
