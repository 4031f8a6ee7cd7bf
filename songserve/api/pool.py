"""The worker pool: who the workers are, what state each is in, and the health poll.

The dispatcher's own assignment is the truth for "busy": the health poll refreshes progress and
marks workers online/offline, but never frees a worker that holds a task. A worker is available
only when it is online, reports ``idle``, and holds no assignment.

Worker states (as ``/status`` shows them): offline, loading, idle, busy, error, stalled.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

import httpx

log = logging.getLogger(__name__)


class WorkerState(StrEnum):
    offline = "offline"
    loading = "loading"
    idle = "idle"
    busy = "busy"
    error = "error"
    stalled = "stalled"


@dataclass
class WorkerHandle:
    worker_id: int
    url: str
    online: bool = False
    failures: int = 0
    health: dict = field(default_factory=dict)
    assigned: tuple[str, int] | None = None  # (job_id, track index)
    task_id: str | None = None
    assigned_at: float = 0.0
    last_progress_at: float = 0.0  # monotonic
    _last_progress: tuple = ()

    @property
    def state(self) -> WorkerState:
        if not self.online:
            return WorkerState.offline
        reported = self.health.get("status")
        if reported in ("error", "stalled"):
            return WorkerState(reported)
        if self.assigned is not None or reported == "busy":
            return WorkerState.busy
        if reported == "initializing":
            return WorkerState.loading
        return WorkerState.idle

    @property
    def available(self) -> bool:
        return self.online and self.assigned is None and self.health.get("status") == "idle"

    def assign(self, key: tuple[str, int], task_id: str) -> None:
        self.assigned, self.task_id = key, task_id
        self.assigned_at = self.last_progress_at = time.monotonic()
        self._last_progress = ()

    def release(self, task_id: str | None) -> None:
        """Free the worker from ``task_id``; a no-op if it has moved on to another task."""
        if self.task_id != task_id:
            return
        self.assigned, self.task_id = None, None
        # Until the next poll says otherwise, assume the worker is idle again (it answered us).
        if self.online and self.health.get("status") == "busy":
            self.health = {**self.health, "status": "idle", "phase": "idle", "progress": 0}

    def mark_unreachable(self) -> None:
        self.online = False
        self.health = {**self.health, "status": "unreachable"}

    def note_health(self, health: dict) -> None:
        self.health = health
        if self.task_id and health.get("task_id") == self.task_id:
            mark = (health.get("phase"), health.get("progress"), health.get("progress_detail"))
            if mark != self._last_progress:
                self._last_progress = mark
                self.last_progress_at = time.monotonic()

    def public(self) -> dict:
        h = self.health
        return {
            "worker_id": self.worker_id,
            "url": self.url,
            "status": self.state.value,
            "phase": h.get("phase", "idle") if self.online else "offline",
            "gpu_id": h.get("gpu_id", self.worker_id),
            "device": h.get("device"),
            "runtime_mode": h.get("runtime_mode"),
            "progress": h.get("progress", 0),
            "task_id": self.task_id,
            "tasks_done": h.get("tasks_done"),
        }


class WorkerPool:
    def __init__(
        self,
        urls: list[str],
        client: httpx.AsyncClient,
        interval: float,
        offline_after: int,
        on_change: Callable[[WorkerHandle, WorkerState], None],
    ) -> None:
        self.workers = [WorkerHandle(i, u) for i, u in enumerate(urls)]
        self.client = client
        self.interval = interval
        self.offline_after = offline_after
        self.on_change = on_change
        self._task: asyncio.Task | None = None

    def by_id(self, worker_id: int) -> WorkerHandle | None:
        return self.workers[worker_id] if 0 <= worker_id < len(self.workers) else None

    def available(self) -> list[WorkerHandle]:
        return [w for w in self.workers if w.available]

    def online_count(self) -> int:
        return sum(w.online for w in self.workers)

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(w) for w in self.workers))

    async def _poll(self, w: WorkerHandle) -> None:
        before = w.state
        try:
            r = await self.client.get(f"{w.url}/health", timeout=max(2.0, 2 * self.interval))
            r.raise_for_status()
            w.note_health(r.json())
            w.online, w.failures = True, 0
        except (httpx.HTTPError, ValueError) as exc:
            w.failures += 1
            if w.online and w.failures >= self.offline_after:
                log.warning("worker %d (%s) offline: %s", w.worker_id, w.url, type(exc).__name__)
                w.online = False
        if w.state != before:
            log.info("worker %d: %s → %s", w.worker_id, before.value, w.state.value)
        self.on_change(w, before)

    async def run(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.interval)

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="health-poll")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
