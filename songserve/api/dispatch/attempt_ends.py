"""Why an attempt stops early, and what the workers' health means for the attempts running there.

The part of ``Attempts`` (``attempts.py`` mixes it in) that ends attempts from outside: the watchdog
(no progress for ``STALL_TIMEOUT_SEC``, past the deadline), a health poll (the worker went offline
or stalled; each running take's progress and phase copied onto its track), the user's cancel, a lost
lease. One stop per attempt: later stops are no-ops; the attempt's own task turns the stop into a
retry, or, for the silent ones (``SILENT``: the lease passed on, or another dispatcher changed the
track first), ends without touching its tracks.

Progress writes carry the attempt's fence like every other write: a phase change refused for a lost
lease stops the attempt there and then, so no health poll acts for a track another dispatcher owns.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

from songserve.api.dispatch.pool import WorkerHandle, WorkerPool, WorkerView
from songserve.api.dispatch.tracks import TrackBook
from songserve.api.jobs.phases import status_of_phase
from songserve.api.jobs.records import Job, Key, Track
from songserve.api.jobs.states import IllegalTransition
from songserve.api.settings import DispatcherSettings
from songserve.api.store.protocol import Fence, JobStore, LeaseLost, StaleTrack, StoreError
from songserve.api.workers.outcomes import WorkerUnreachable
from songserve.errors import SongserveError

log = logging.getLogger(__name__)
LEASE_LOST = "its worker's lease passed to another dispatcher"
TAKEN_OVER = "another dispatcher changed it first"
SILENT = (LEASE_LOST, TAKEN_OVER)  # stops that end an attempt without touching its tracks
USER_CANCEL = "cancelled by the user"
PROGRESS_WRITE_SEC = 1.0  # a running track's progress reaches the store at most this often


class AttemptStops:
    """Stopping attempts, and following the workers' health; the state is ``Attempts``'."""

    s: DispatcherSettings
    store: JobStore
    book: TrackBook
    pool: WorkerPool
    running: dict[Key, asyncio.Task[None]]
    _stopping: dict[Key, str]
    _deadlines: dict[Key, float]
    _progress_saved: dict[Key, float]
    _fences: dict[Key, Fence]
    _collecting: set[Key]

    def deadline(self, job: Job) -> float:
        """Seconds an attempt of ``job``'s tracks may take."""
        return self.s.deadline_base_sec + self.s.deadline_factor * job.request.duration * 60

    # ---- stopping an attempt --------------------------------------------------------------------
    def stop(self, key: Key, reason: str) -> None:
        """Ask a running attempt to stop and retry; later requests for the same attempt are no-ops."""
        task = self.running.get(key)
        if task is None or task.done() or key in self._stopping:
            return
        self._stopping[key] = reason
        log.warning("track %s/%d: %s", *key, reason)
        task.cancel(reason)

    async def _cancel_on_worker(self, w: WorkerHandle, task_id: str | None) -> None:
        """Tell the worker to stop; shielded, so a shutdown arriving meanwhile does not cut it short."""
        if task_id is None:
            return
        try:
            await asyncio.shield(w.client.cancel(task_id, timeout=2))
        except WorkerUnreachable:
            pass

    async def cancel_running(self, tracks: list[Track]) -> None:
        """The user cancelled: each worker answers its running request with "cancelled" at its next
        check; a track whose worker does not know the task (or cannot stop one), or whose files are
        being copied (or wait for the results folder), stops here."""
        for t in tracks:
            if t.key in self._collecting:
                self.stop(t.key, USER_CANCEL)
                continue
            w = self.pool.by_id(t.worker_id)
            known = False
            if w is not None and t.task_id is not None:
                try:
                    known = await w.client.cancel(t.task_id)
                except SongserveError:
                    known = False
            if not known:
                self.stop(t.key, USER_CANCEL)

    def watch(self) -> None:
        """The watchdog's part: no progress for stall_timeout, or past the deadline: the attempt stops
        (and its track goes to another worker)."""
        now = time.monotonic()
        for w in self.pool.workers:
            stalled = bool(w.assigned) and now - w.last_progress_at > self.s.stall_timeout_sec
            for key in list(w.assigned.values()):
                if stalled:
                    w.stalled = True
                    self.stop(key, f"worker {w.worker_id} made no progress for {now - w.last_progress_at:.0f}s")
                elif now > self._deadlines.get(key, math.inf) and (job := self.book.jobs.get(key[0])) is not None:
                    self.stop(key, f"past its deadline of {self.deadline(job):.0f}s")

    # ---- what a health poll means for the attempts on a worker ----------------------------------
    async def on_health(self, w: WorkerHandle, before: WorkerView) -> None:
        """Refresh the running tracks' progress from ``w``'s health; stop them if the worker is lost."""
        for task_id, key in list(w.assigned.items()):
            job = self.book.jobs.get(key[0])
            if job is None:
                continue
            t = job.tracks[key[1]]
            try:
                await self._show(w, t, task_id)
            except LeaseLost:
                self.stop(key, LEASE_LOST)
            except StaleTrack:
                self.stop(key, TAKEN_OVER)
            except (StoreError, IllegalTransition) as exc:  # progress only: the next poll writes it again
                log.warning("track %s/%d: its progress from worker %d not stored (%s)", *key, w.worker_id, exc)
            if not w.online and before is not WorkerView.offline:
                self.stop(key, f"worker {w.worker_id} went offline")
            elif w.health.status == "stalled" and before is not WorkerView.stalled:
                self.stop(key, f"worker {w.worker_id} reported its model thread stalled")

    async def _show(self, w: WorkerHandle, t: Track, task_id: str) -> None:
        """The worker's progress of ``task_id`` onto its track: a new phase is a state change (stored
        first), the rest is shown at once and stored at most once a second."""
        take = w.progress_of(task_id) if w.online and t.status.running and t.task_id == task_id else None
        if take is None:
            return
        fields = {"worker_phase": take.phase, "phase_progress": int(take.progress),
                  "phase_detail": take.progress_detail, "phase_rate": take.tokens_per_sec,
                  "preview_sec": take.preview_sec or 0.0}  # fmt: skip
        status = status_of_phase(take.phase)
        if status is not t.status:
            await self.book.change(t, status, fence=self._fences.get(t.key), **fields)
            self._progress_saved[t.key] = time.monotonic()
        elif self.book.show_progress(t, fields):
            await self._save_progress(t)
        else:
            return
        await self.book.progress_event(t)  # the job's webhook, if it asked for progress

    async def _save_progress(self, t: Track) -> None:
        """Other dispatchers show a track's progress from the store: write it, at most once a second."""
        if not self.store.shared:
            return
        now = time.monotonic()
        if now - self._progress_saved.get(t.key, 0.0) >= PROGRESS_WRITE_SEC:
            self._progress_saved[t.key] = now
            await self.store.save_progress(t, self._fences.get(t.key))
