"""Attempts: one attempt of a track (or of a batch of one job's takes) on one worker, top to bottom.

An attempt, in the order it happens, and in this order below:
1. ``begin``: each take gets a fresh task id and is claimed in the store (``TrackBook.claim``); the
   takes won are assigned to the worker and one asyncio task runs them (``reattach`` starts one for
   a track already running on a worker, after a restart or a lease take-over); a retake's takes
   carry the frames it keeps (``retakes.kept_frames``, read before the claim);
2. ``_run``: the worker's answer, one ``Outcome`` per take (``WorkerClient.generate_batch``, or
   ``/tasks/{id}`` polled for a reattached track); the worker is released at once;
3. ``_apply``: done → its files copied and checked (``ArtifactStore.collect``) and the track done;
   a clear model error → the track failed; cancelled by the worker, busy, an environment failure →
   a retry;
4. ``_retry_after``: every failure on the way is a retry of the tracks it touched (``RetryTrack``)
   while attempts remain (``TrackBook.retry``), never a stuck track.

Why an attempt stops early: its worker went offline or stalled (``on_health``), no progress or past
its deadline (``watch``), the user cancelled, its worker left the pool or its lease was lost. One
stop per attempt: later stops of the same attempt are no-ops (``stop``); the worker-side cancel
that follows is shielded from further cancels; a lost lease ends the attempt silently (the new
holder reattaches the task). Only the current task id's outcome is applied, so a retried track
finishes once.

Whose fault: an answer that is not the contract or files that are not what the worker said
(``WorkerFault``) are the worker's: charged to it (``_charge``, its breaker) and the track runs
elsewhere without losing an attempt. A results folder we cannot write is ours: the track waits.

Fencing (``dispatch/attempt_fences.py``): every write an attempt makes carries the lease it was claimed
under; a write refused for a lost lease (``LeaseLost``) ends the attempt without touching the track.
One asyncio task per track at a time (``_spawn`` refuses a second), so nothing else acts on a track
while an attempt holds it. No error escapes the handling of a worker's answer (``_conclude``): a
track whose outcome could not be stored stays running here and the watchdog's repair asks the worker
again (``reconcile``), which collects a finished result instead of generating it again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from songserve.api.dispatch import retakes
from songserve.api.dispatch.attempt_ends import SILENT, AttemptStops
from songserve.api.dispatch.attempt_fences import AttemptFences
from songserve.api.dispatch.estimates import SpeedHistory
from songserve.api.dispatch.pool import WorkerHandle, WorkerPool
from songserve.api.dispatch.tracks import TrackBook
from songserve.api.jobs.records import Job, Key, Track
from songserve.api.jobs.states import TrackStatus
from songserve.api.metrics import DispatcherMetrics
from songserve.api.results.artifacts import ArtifactStore
from songserve.api.settings import DispatcherSettings
from songserve.api.store.protocol import Fence, JobStore, LeaseLost, StaleTrack, StoreError, background_context
from songserve.api.workers.outcomes import Outcome, OutcomeKind, TaskLost, WorkerFault, WorkerUnreachable
from songserve.api.workers.to_worker import result_metadata, result_seed, worker_request

log = logging.getLogger(__name__)


class RetryTrack(Exception):
    """The track should run again; ``count`` is False when the attempt never started, or when the
    worker failed it for an environment reason (``environment``: disk, memory, writes)."""

    def __init__(self, reason: str, count: bool = True, environment: bool = False) -> None:
        super().__init__(reason)
        self.count = count and not environment
        self.environment = environment


class Attempts(AttemptStops, AttemptFences):
    """This dispatcher's attempts: which run (``running``), how each goes, and why one stops."""

    def __init__(
        self,
        s: DispatcherSettings,
        me: str,
        store: JobStore,
        book: TrackBook,
        pool: WorkerPool,
        artifacts: ArtifactStore,
        metrics: DispatcherMetrics,
        speed: SpeedHistory,
        kick: Callable[[], None],
    ) -> None:
        self.s = s
        self.me = me
        self.store = store
        self.book = book
        self.pool = pool
        self.artifacts = artifacts
        self.metrics = metrics
        self.speed = speed
        self.kick = kick  # a worker may be free now: the dispatch loop looks again
        self.running: dict[Key, asyncio.Task[None]] = {}  # this dispatcher's attempts, by track
        self._stopping: dict[Key, str] = {}  # attempts asked to stop, with the reason
        self._deadlines: dict[Key, float] = {}  # monotonic
        self._progress_saved: dict[Key, float] = {}  # monotonic time of a running track's last progress write
        self._collecting: set[Key] = set()  # tracks whose files are being copied (or wait for the results folder)
        self._fences: dict[Key, Fence] = {}  # the lease each running attempt's writes are made under

    # ---- one attempt, in order ------------------------------------------------------------------
    async def begin(self, job: Job, tracks: list[Track], w: WorkerHandle, missing: str = "") -> bool:
        """Claim ``tracks`` (takes of one job, in order) in the store and start them on ``w`` as one
        attempt (one batch when several). Returns False when another dispatcher had claimed them all.
        ``missing``: why a continuation's kept frames never will be there (its upload failed): its takes fail so."""
        now = time.time()
        wanted = []
        for t in tracks:
            attempt = t.attempts + 1
            # Unique per try: attempts that did not count (busy, environment) must not reuse a task id.
            task_id = f"{job.job_id}-{t.index}-{attempt}-{secrets.token_hex(3)}"
            wanted.append(dataclasses.replace(
                t, status=TrackStatus.generating, attempts=attempt, task_id=task_id, worker_id=w.worker_id,
                owner=self.me, error=None, started_at=now, worker_phase="backbone", phase_progress=0,
                phase_detail="", phase_rate=None, preview_sec=0.0))  # fmt: skip
        # A retake's kept frames, read before the claim: from the claim to ``_spawn`` nothing awaits.
        retake = job.request.continue_from is not None and not missing
        prefix = await retakes.kept_frames(self.artifacts, job) if retake else None
        fence = self.fence_of(w)
        if fence is None:
            return False
        try:
            started = await self.book.claim(job, tracks, wanted, fence)
        except LeaseLost:
            log.warning("worker %d: %s is not held here any more; no track sent (job %s)", w.worker_id, fence,
                        job.job_id)  # fmt: skip
            w.lease_valid_until = 0.0  # not used again before the membership reads its leases
            return False
        if not started:
            return False
        for t in started:
            self.metrics.queue_wait.observe(now - (t.queued_at or job.created_at))
            self._fences[t.key] = fence
            w.assign(t.key, t.task_id or "")
            self._deadlines[t.key] = time.monotonic() + self.deadline(job)
            log.info("track %s/%d: attempt %d on worker %d (task %s, batch of %d)", *t.key, t.attempts, w.worker_id,
                     t.task_id, len(started))  # fmt: skip
        reqs, lease = [worker_request(job, t, prefix) for t in started], self.lease_header(fence)
        if job.request.continue_from is not None and prefix is None:  # never a take of the prompt alone instead
            obtain: Callable[[], Awaitable[list[Outcome]]] = retakes.frames_gone(len(started), missing)
        else:
            obtain = functools.partial(w.client.generate_batch, reqs, lease)
        self._spawn([t.key for t in started], self._run(job, started, w, obtain))
        if job.started_at is None:
            job.started_at = now
            start = self.book.events.of(job, "start", None, self.book.positions)  # the job's webhook, if it asked
            try:
                await self.store.mark_started(job.job_id, now, start)
            except StoreError as exc:  # a timestamp: the job's view falls back to its tracks' start
                log.warning("job %s: its start could not be stored (%s)", job.job_id, exc)
        return True

    def reattach(self, job: Job, t: Track) -> bool:
        """After a restart, a lease take-over or a failed store write: follow a track already running on
        its worker through ``/tasks/{id}``: collected if finished, awaited if running, re-queued if the
        worker lost it. False when an attempt already holds the track."""
        return self._spawn([t.key], self._follow(job, t))

    reconcile = reattach  # the watchdog's repair: a track shown running here with no attempt behind it

    def abandon(self, job: Job, t: Track, reason: str) -> bool:
        """A running track whose worker is gone from the registry goes back to the queue (as an attempt
        of its own, so nothing else acts on it meanwhile). False when an attempt already holds it."""
        return self._spawn([t.key], self._conclude(job, t, self.book.retry(job, t, reason, count=False)))

    async def _follow(self, job: Job, t: Track) -> None:
        w = self.pool.by_id(t.worker_id)
        if w is None or t.task_id is None:
            await self._conclude(job, t, self.book.retry(job, t, "its worker is no longer configured", count=False))
            return
        key, task_id = (job.job_id, t.index), t.task_id
        if (fence := self.fence_of(w)) is None:  # not leased here (any more): the holder reconciles it
            log.info("track %s/%d: not followed, worker %d is not leased here", *key, w.worker_id)
            return
        self._fences[key] = fence
        w.assign(key, task_id)
        self._deadlines[key] = time.monotonic() + self.deadline(job)

        async def outcome() -> list[Outcome]:
            while True:
                try:
                    done = await w.client.task(task_id, self.lease_header(self._fences.get(key)))
                except WorkerUnreachable as exc:
                    if not w.online or isinstance(exc, WorkerFault):  # a bad answer is not waited out
                        raise
                    done = None
                if done is not None:
                    log.info("track %s/%d: reconciled task %s (%s)", *key, task_id, done.kind.value)
                    return [done]
                await asyncio.sleep(self.s.health_interval)

        await self._run(job, [t], w, outcome)

    async def _run(
        self, job: Job, tracks: list[Track], w: WorkerHandle, obtain: Callable[[], Awaitable[list[Outcome]]]
    ) -> None:
        """Get the attempt's outcomes from its worker (one per take), then apply each; every
        failure becomes a retry of the tracks it touched."""
        keys = [(job.job_id, t.index) for t in tracks]
        task_ids = [t.task_id for t in tracks]
        try:
            try:
                outcomes = await obtain()
            except asyncio.CancelledError:
                reason = next((self._stopping[k] for k in keys if k in self._stopping), None)
                if reason is None:  # shutdown: the tracks stay running in the store and are reconciled
                    raise
                asyncio.current_task().uncancel()  # type: ignore[union-attr]
                if reason in SILENT:  # the worker's lease holder reconciles these tasks: leave them be
                    self.book.resync(job.job_id)  # and learn the state it leaves them in
                    return
                for task_id in task_ids:
                    await self._cancel_on_worker(w, task_id)
                raise RetryTrack(reason) from None
            except WorkerFault as exc:
                raise self._charge(w, str(exc)) from None
            except WorkerUnreachable as exc:
                w.mark_unreachable()
                raise RetryTrack(f"worker {w.worker_id} connection lost ({exc})") from None
            except TaskLost as exc:
                raise RetryTrack(str(exc)) from None
            # The worker answered: its model thread is free. Give it the next track while the
            # files are copied (as long as its copies keep up: ``WorkerHandle.available``).
            busy = any(o.kind is OutcomeKind.busy for o in outcomes)
            for task_id in task_ids:
                w.release(task_id, answered=not busy)
            w.collecting += 1
            self.kick()
            try:
                for t, task_id, outcome in zip(tracks, task_ids, outcomes, strict=True):
                    await self._conclude(job, t, self._apply_or_retry(job, t, w, task_id, outcome))
            finally:
                w.collecting -= 1
        except RetryTrack as exc:
            for t in tracks:
                await self._conclude(job, t, self._retry_after(job, t, w, exc))
        except Exception as exc:
            log.exception("track %s/%d: internal error", *keys[0])
            for t in tracks:
                await self._conclude(job, t, self.book.retry(job, t, f"internal error ({type(exc).__name__})",
                                                             fence=self._fences.get(t.key)))  # fmt: skip
        finally:
            for key, task_id in zip(keys, task_ids, strict=True):
                self._stopping.pop(key, None)
                self._deadlines.pop(key, None)
                self._progress_saved.pop(key, None)
                self._fences.pop(key, None)
                w.release(task_id, answered=False)
            self.kick()

    async def _apply_or_retry(self, job: Job, t: Track, w: WorkerHandle, task_id: str | None, outcome: Outcome) -> None:
        try:
            await self._apply(job, t, w, task_id, outcome)
        except RetryTrack as exc:
            await self._retry_after(job, t, w, exc)

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
                await self.book.retry(job, t, f"internal error ({type(exc).__name__})", fence=self._fences.get(t.key))
            except Exception as again:  # the store: the repair comes back to it
                log.warning("track %s/%d: its retry could not be stored (%s)", *t.key, again)

    async def _apply(self, job: Job, t: Track, w: WorkerHandle, task_id: str | None, outcome: Outcome) -> None:
        """What the worker's answer means for the track (raises ``RetryTrack`` for another attempt)."""
        if t.task_id != task_id or t.status.terminal:
            log.info("track %s/%d: ignoring outcome of superseded task %s", job.job_id, t.index, task_id)
            return
        fence = self._fences.get(t.key)
        if fence is not None and (fence.epoch != w.lease_epoch or time.monotonic() >= w.lease_valid_until):
            # Lost, or not renewed in time (a pause?): not even the files. The repair asks the worker
            # again once the membership has read the lease (still ours: collected then).
            raise LeaseLost(t.key, fence)
        if outcome.kind is OutcomeKind.done and outcome.result is not None and job.cancelled:
            await self.book.change(t, TrackStatus.cancelled, fence=fence, finished_at=time.time(), owner=None)
            await self._remove_worker_files(w, task_id)  # cancelled as it finished: its files are not wanted
        elif outcome.kind is OutcomeKind.done and outcome.result is not None:
            res, s = outcome.result, self.s
            self._collecting.add(t.key)  # held while the results folder cannot be written: nobody is charged
            try:
                await self.artifacts.collect(w.client, res, job.job_id, t.index, int(s.max_result_mb * 2**20),
                                             s.download_timeout_sec, s.download_floor_kb_per_sec * 1000)  # fmt: skip
            except WorkerFault as exc:
                raise self._charge(w, f"the files of task {task_id}: {exc}") from None
            except asyncio.CancelledError:  # stopped while copying or held: the user cancelled
                if (reason := self._stopping.get(t.key)) is None:  # shutdown: reconciled at the next start
                    raise
                asyncio.current_task().uncancel()  # type: ignore[union-attr]
                raise RetryTrack(reason) from None
            finally:
                self._collecting.discard(t.key)
            now = time.time()
            meta = result_metadata(res, w.worker_id)
            meta["file_bytes"] = self.artifacts.sizes(job.job_id, t.index)
            await self.book.change(t, TrackStatus.done, fence=fence, finished_at=now, duration_sec=res.duration_sec,
                                   metadata=meta, seed=result_seed(res, t.seed), owner=None)  # fmt: skip
            models, wall = res.metadata.get("models"), now - (t.started_at or now)
            self.speed.record(str(models.get("backbone", "")) if isinstance(models, dict) else "", t.duration_sec, wall)
            self.metrics.track_done(res.metadata, now - job.created_at, wall, t.duration_sec)
            w.track_succeeded()
            await self._remove_worker_files(w, task_id)
            log.info("track %s/%d: done (%.1fs audio, %.1fs)", job.job_id, t.index, t.duration_sec, wall)
        elif outcome.kind is OutcomeKind.cancelled:
            # The job may have been cancelled at another dispatcher a moment ago: the store knows.
            job.cancelled = job.cancelled or await self.store.is_cancelled(job.job_id)
            if not job.cancelled:
                raise RetryTrack(f"worker {w.worker_id} stopped the task")
            await self.book.change(t, TrackStatus.cancelled, fence=fence, finished_at=time.time(), owner=None)
        elif outcome.kind is OutcomeKind.busy:
            raise RetryTrack(f"worker {w.worker_id} was busy", count=False)
        else:
            s = self.s
            if w.track_failed(outcome.environment, s.bench_after_failures, s.bench_sec, outcome.error):
                self.kick()
            if outcome.environment and t.env_failures + 1 < s.max_attempts * max(1, len(self.pool.workers)):
                raise RetryTrack(f"worker {w.worker_id}: {outcome.error}", environment=True)
            await self.book.change(t, TrackStatus.error, fence=fence, error=outcome.error, finished_at=time.time(),
                                   owner=None)  # fmt: skip
            log.warning("track %s/%d: error: %s", job.job_id, t.index, outcome.error)
        await self.book.finish_if_done(job)

    def _charge(self, w: WorkerHandle, reason: str) -> RetryTrack:
        """A failure of the worker's own: counted by its breaker; its tracks run elsewhere, no attempt lost."""
        self.metrics.worker_faults.labels(str(w.worker_id)).inc()
        log.warning("worker %d: charged: %s", w.worker_id, reason)
        if w.track_failed(True, self.s.bench_after_failures, self.s.bench_sec, reason):
            self.kick()
        return RetryTrack(f"worker {w.worker_id}: {reason}", environment=True)

    async def _retry_after(self, job: Job, t: Track, w: WorkerHandle, exc: RetryTrack) -> None:
        count = exc.count
        t.avoid_worker = w.worker_id  # not back there while another worker can take it (``placement.pick``)
        if exc.environment:
            t.env_failures += 1
            # Past every worker's share of tries they count again: a fleet that all misbehaves ends the track.
            count = t.env_failures >= self.s.max_attempts * max(1, len(self.pool.workers))
        await self.book.retry(job, t, str(exc), count, fence=self._fences.get(t.key))

    async def _remove_worker_files(self, w: WorkerHandle, task_id: str | None) -> None:
        """The files are ours now: the worker may delete its copies (its age sweep is the safety net)."""
        if task_id is None:
            return
        try:
            await w.client.remove_files(task_id)
        except WorkerUnreachable as exc:
            log.info("worker %d: files of %s not removed (%s)", w.worker_id, task_id, exc)

    # ---- the asyncio tasks that run attempts ----------------------------------------------------
    def _spawn(self, keys: list[Key], coro: Coroutine[Any, Any, None]) -> bool:
        """One asyncio task runs one attempt of ``keys`` (several: the takes of one batch), on the store's
        background lane (a route that started it does not lend it its connections). Refused (False)
        while an attempt already holds one of them."""
        if any(k in self.running and not self.running[k].done() for k in keys):
            coro.close()
            log.info("track %s/%d: an attempt already holds it", *next(k for k in keys if k in self.running))
            return False
        name = f"track-{keys[0][0]}-{'+'.join(str(k[1]) for k in keys)}"
        task = asyncio.create_task(coro, name=name, context=background_context())
        for key in keys:
            self.running[key] = task
            task.add_done_callback(functools.partial(self._task_done, key))
        return True

    def _task_done(self, key: Key, task: asyncio.Task[None]) -> None:
        if self.running.get(key) is task:
            del self.running[key]
        if not task.cancelled() and task.exception() is not None:
            log.error("track %s/%d: unexpected failure", *key, exc_info=task.exception())
        self.kick()
