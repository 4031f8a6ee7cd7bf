"""How an attempt ends other than by its answer: chapters 3 and 4 of its story (1 and 2: ``attempts.py``).

3. Its stop. From outside, once per attempt (``stop``; later stops of the same attempt are no-ops):
   the watchdog (no progress for ``STALL_TIMEOUT_SEC``, past its ``deadline``: ``watch``), the
   health poll (its worker went offline or stalled: ``Attempts.on_health``), the user's cancel
   (``cancel_running``), its worker leaving the pool, its lease lost. The attempt's own task then
   cancels the task on the worker (shielded from further cancels: ``_cancel_on_worker``) and turns
   the stop into a retry. From inside, every failure on the way is a retry of the tracks it touched
   (``RetryTrack``, ``_retry_after``): the track is not sent back to the worker that failed it while
   another can take it, and ``retry`` gives it its next state: cancelled if its job was, an error
   when its tries ran out, else queued again (which failures cost a try: ``retries.py``).
4. Its fence. Every write an attempt makes for its tracks carries the lease it was claimed under
   (``_fences``: this dispatcher, the worker, the lease's epoch; the worker is told it too,
   ``lease_header``, and refuses a task sent under an older one: ``worker/fence.py``). A write
   refused for a lost lease (``LeaseLost``) or for a track another dispatcher changed first
   (``StaleTrack``) ends this dispatcher's part without touching the track, as do the silent stops
   (``SILENT``): the lease's holder reconciles it with the worker. No error escapes the handling of
   an answer (``_conclude``): an outcome the store could not take leaves the track running here, for
   the watchdog's repair to ask the worker again. The membership asks here whether a lease may be
   given back (``fenced_on``) and moves the attempts onto a lease it re-took unchanged (``refence``).

Where the story divides, and why here: its four chapters are more than a module's 400 lines, and
they part where the attempt stops being the actor. In 1 and 2 the attempt's own task does what it
came to do, in the order it does it; in 3 and 4 what happens around it (a stop, a failed answer, a
write the store refuses, a lease that moves) decides how it ends, and the dispatcher's loops and the
membership call in here. ``Attempts`` holds the state and mixes this part in.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Awaitable

from songserve.api.dispatch import retries
from songserve.api.dispatch.pool import WorkerHandle, WorkerPool
from songserve.api.dispatch.retries import RetryTrack
from songserve.api.dispatch.tracks import TrackBook
from songserve.api.jobs.records import Job, Key, Track
from songserve.api.jobs.states import TrackStatus
from songserve.api.metrics import DispatcherMetrics
from songserve.api.settings import DispatcherSettings
from songserve.api.store.members import Fence
from songserve.api.store.protocol import JobStore, LeaseLost, StaleTrack, StoreError
from songserve.api.workers.outcomes import WorkerUnreachable
from songserve.errors import SongserveError

log = logging.getLogger(__name__)
LEASE_LOST = "its worker's lease passed to another dispatcher"
TAKEN_OVER = "another dispatcher changed it first"
SILENT = (LEASE_LOST, TAKEN_OVER)  # stops that end an attempt without touching its tracks
USER_CANCEL = "cancelled by the user"
IDLE: dict[str, object] = {
    "worker_phase": "idle", "phase_progress": 0, "phase_detail": "", "phase_rate": None, "preview_sec": 0.0,
}  # fmt: skip


class AttemptEnds:
    """Stopping attempts, retrying their tracks, and the leases they write under; the state is ``Attempts``'."""

    s: DispatcherSettings
    me: str
    store: JobStore
    book: TrackBook
    pool: WorkerPool
    metrics: DispatcherMetrics
    running: dict[Key, asyncio.Task[None]]
    _stopping: dict[Key, str]
    _deadlines: dict[Key, float]
    _fences: dict[Key, Fence]
    _collecting: set[Key]

    # ---- 3. the stop ----------------------------------------------------------------------------
    def deadline(self, job: Job) -> float:
        """Seconds an attempt of ``job``'s tracks may take."""
        return self.s.deadline_base_sec + self.s.deadline_factor * job.request.duration * 60

    def stop(self, key: Key, reason: str) -> None:
        """Ask a running attempt to stop and retry; later requests for the same attempt are no-ops."""
        task = self.running.get(key)
        if task is None or task.done() or key in self._stopping:
            return
        self._stopping[key] = reason
        log.warning("track %s/%d: %s", *key, reason)
        task.cancel(reason)

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

    async def _cancel_on_worker(self, w: WorkerHandle, task_id: str | None) -> None:
        """Tell the worker to stop; shielded, so a shutdown arriving meanwhile does not cut it short."""
        if task_id is None:
            return
        try:
            await asyncio.shield(w.client.cancel(task_id, timeout=2))
        except WorkerUnreachable:
            pass

    async def _retry_after(self, job: Job, t: Track, w: WorkerHandle, exc: RetryTrack) -> None:
        count = exc.count
        t.avoid_worker = w.worker_id  # not back there while another worker can take it (``placement.pick``)
        if exc.environment:
            t.env_failures += 1
            # Past every worker's share of tries they count again: a fleet that all misbehaves ends the track.
            count = t.env_failures >= retries.environment_share(self.s.max_attempts, len(self.pool.workers))
        await self.retry(job, t, str(exc), count, fence=self._fences.get(t.key))

    async def retry(self, job: Job, t: Track, reason: str, count: bool = True, fence: Fence | None = None) -> None:
        """The track runs again (queued), unless its job was cancelled or its attempts ran out."""
        if t.status.terminal:
            return
        self.metrics.retries.labels(str(t.worker_id)).inc()
        attempts = retries.tries_used(t.attempts, count)
        now = time.time()
        if job.cancelled or await self.store.is_cancelled(job.job_id):
            job.cancelled = True
            await self.book.change(t, TrackStatus.cancelled, fence, attempts=attempts, finished_at=now, owner=None)
        elif (msg := retries.given_up(attempts, self.s.max_attempts, reason)) is not None:
            await self.book.change(t, TrackStatus.error, fence, attempts=attempts, error=msg, finished_at=now,
                                   owner=None)  # fmt: skip
            log.warning("track %s/%d: %s", job.job_id, t.index, msg)
        else:
            log.warning("track %s/%d: retrying (%s)", job.job_id, t.index, reason)
            await self.book.change(t, TrackStatus.queued, fence, attempts=attempts, worker_id=-1, owner=None, **IDLE)
            self.book.enqueue(job, t)
            self.book.reorder()
        await self.book.finish_if_done(job)

    # ---- 4. the fence ---------------------------------------------------------------------------
    async def _conclude(self, job: Job, t: Track, step: Awaitable[None]) -> None:
        """Run one step that writes a track's outcome; no error escapes it. A lost lease or a track
        changed elsewhere ends this dispatcher's part; a store failure leaves the track running here,
        for the repair to ask its worker again; anything else is a retry of the track."""
        try:
            await step
        except LeaseLost as exc:
            log.warning("track %s/%d: %s is gone; this dispatcher stops acting for it (task %s)", *t.key, exc.fence,
                        t.task_id)  # fmt: skip
        except StaleTrack:
            log.warning("track %s/%d: another dispatcher changed it first; leaving it to them", *t.key)
        except StoreError as exc:
            log.warning("track %s/%d: its outcome could not be stored (%s); the repair asks worker %d again",
                        *t.key, exc, t.worker_id)  # fmt: skip
        except Exception as exc:
            log.exception("track %s/%d: internal error", *t.key)
            try:
                await self.retry(job, t, f"internal error ({type(exc).__name__})", fence=self._fences.get(t.key))
            except Exception as again:  # the store: the repair comes back to it
                log.warning("track %s/%d: its retry could not be stored (%s)", *t.key, again)

    def fence_of(self, w: WorkerHandle) -> Fence | None:
        """The lease this dispatcher holds on ``w`` now (None: none)."""
        return Fence(self.me, w.worker_id, w.lease_epoch) if w.leased and w.lease_epoch else None

    def lease_header(self, fence: Fence | None) -> str | None:
        """What the worker is told of the lease a call is made under (``worker/fence.py``)."""
        return f"{self.store.ident} {fence.epoch}" if fence is not None and self.store.ident else None

    def fenced_on(self, worker_id: int) -> bool:
        """Whether an attempt of this dispatcher still writes under its lease on ``worker_id`` (the
        worker may be free while its answer is applied): that lease is not given back yet."""
        return any(f.worker_id == worker_id for f in self._fences.values())

    def refence(self, w: WorkerHandle, old: int, new: int) -> None:
        """This dispatcher re-took ``w``'s lease and nobody held it between (epoch ``old`` + 1 = ``new``):
        the attempts there go on under the new epoch."""
        for key, f in list(self._fences.items()):
            if f.worker_id == w.worker_id and f.epoch == old:
                self._fences[key] = dataclasses.replace(f, epoch=new)
