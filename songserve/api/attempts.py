"""Attempts: one attempt of a track (or of a batch of one job's takes) on one worker, top to bottom.

An attempt, in the order it happens, and in this order below:
1. ``begin``: each take gets a fresh task id and is claimed in the store (``TrackBook.claim``); the
   takes won are assigned to the worker and one asyncio task runs them (``reattach`` starts one for
   a track already running on a worker, after a restart or a lease take-over);
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
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from songserve.api.artifacts import ArtifactStore
from songserve.api.estimates import SpeedHistory
from songserve.api.metrics import DispatcherMetrics
from songserve.api.outcomes import Outcome, OutcomeKind, TaskLost, WorkerFault, WorkerUnreachable
from songserve.api.phases import status_of_phase
from songserve.api.pool import WorkerHandle, WorkerPool, WorkerView
from songserve.api.states import TrackStatus
from songserve.api.store import Job, JobStore, Key, StaleTrack, Track
from songserve.api.to_worker import result_metadata, result_seed, worker_request
from songserve.api.tracks import TrackBook
from songserve.errors import SongserveError
from songserve.settings import DispatcherSettings

log = logging.getLogger(__name__)
LEASE_LOST = "its worker's lease passed to another dispatcher"
USER_CANCEL = "cancelled by the user"
PROGRESS_WRITE_SEC = 1.0  # a running track's progress reaches the store at most this often


class RetryTrack(Exception):
    """The track should run again; ``count`` is False when the attempt never started, or when the
    worker failed it for an environment reason (``environment``: disk, memory, writes)."""

    def __init__(self, reason: str, count: bool = True, environment: bool = False) -> None:
        super().__init__(reason)
        self.count = count and not environment
        self.environment = environment


class Attempts:
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

    # ---- one attempt, in order ------------------------------------------------------------------
    async def begin(self, job: Job, tracks: list[Track], w: WorkerHandle) -> bool:
        """Claim ``tracks`` (takes of one job, in order) in the store and start them on ``w`` as one
        attempt (one batch when several). Returns False when another dispatcher had claimed them all."""
        now = time.time()
        wanted = []
        for t in tracks:
            attempt = t.attempts + 1
            # Unique per try: attempts that did not count (busy, environment) must not reuse a task id.
            task_id = f"{job.job_id}-{t.index}-{attempt}-{secrets.token_hex(3)}"
            wanted.append(dataclasses.replace(
                t, status=TrackStatus.generating, attempts=attempt, task_id=task_id, worker_id=w.worker_id,
                owner=self.me, error=None, started_at=now, worker_phase="backbone", phase_progress=0,
                phase_detail="", phase_rate=None))  # fmt: skip
        started = await self.book.claim(job, tracks, wanted)
        if not started:
            return False
        for t in started:
            self.metrics.queue_wait.observe(now - (t.queued_at or job.created_at))
            w.assign(t.key, t.task_id or "")
            self._deadlines[t.key] = time.monotonic() + self.deadline(job)
            log.info("track %s/%d: attempt %d on worker %d (task %s, batch of %d)", *t.key, t.attempts, w.worker_id,
                     t.task_id, len(started))  # fmt: skip
        reqs = [worker_request(job, t) for t in started]
        self._spawn([t.key for t in started], self._run(job, started, w, lambda: w.client.generate_batch(reqs)))
        if job.started_at is None:
            job.started_at = now
            await self.store.mark_started(job.job_id, now)
        return True

    def reattach(self, job: Job, t: Track) -> None:
        """After a restart or a lease take-over: follow a track already running on its worker."""
        self._spawn([t.key], self._follow(job, t))

    async def _follow(self, job: Job, t: Track) -> None:
        w = self.pool.by_id(t.worker_id)
        if w is None or t.task_id is None:
            await self.book.retry(job, t, "its worker is no longer configured", count=False)
            return
        key, task_id = (job.job_id, t.index), t.task_id
        w.assign(key, task_id)
        self._deadlines[key] = time.monotonic() + self.deadline(job)

        async def outcome() -> list[Outcome]:
            while True:
                try:
                    done = await w.client.task(task_id)
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
                if reason == LEASE_LOST:  # the worker's new holder reattaches these tasks: leave them be
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
                    try:
                        await self._apply(job, t, w, task_id, outcome)
                    except RetryTrack as exc:
                        await self._retry_after(job, t, w, exc)
            finally:
                w.collecting -= 1
        except RetryTrack as exc:
            for t in tracks:
                await self._retry_after(job, t, w, exc)
        except StaleTrack as exc:
            log.warning("track %s/%d: another dispatcher took it over", *exc.key)
        except Exception as exc:
            log.exception("track %s/%d: internal error", *keys[0])
            for t in tracks:
                await self.book.retry(job, t, f"internal error ({type(exc).__name__})")
        finally:
            for key, task_id in zip(keys, task_ids, strict=True):
                self._stopping.pop(key, None)
                self._deadlines.pop(key, None)
                self._progress_saved.pop(key, None)
                w.release(task_id, answered=False)
            self.kick()

    async def _apply(self, job: Job, t: Track, w: WorkerHandle, task_id: str | None, outcome: Outcome) -> None:
        """What the worker's answer means for the track (raises ``RetryTrack`` for another attempt)."""
        if t.task_id != task_id or t.status.terminal:
            log.info("track %s/%d: ignoring outcome of superseded task %s", job.job_id, t.index, task_id)
            return
        if outcome.kind is OutcomeKind.done and outcome.result is not None and job.cancelled:
            await self.book.change(t, TrackStatus.cancelled, finished_at=time.time(), owner=None)
            await self._remove_worker_files(w, task_id)  # cancelled as it finished: its files are not wanted
        elif outcome.kind is OutcomeKind.done and outcome.result is not None:
            res, s = outcome.result, self.s
            self._collecting.add(t.key)  # held while the results folder cannot be written: nobody is charged
            try:
                await self.artifacts.collect(w.client, res, job.job_id, t.index, int(s.max_result_mb * 2**20),
                                             s.download_timeout_sec)  # fmt: skip
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
            await self.book.change(t, TrackStatus.done, finished_at=now, duration_sec=res.duration_sec,
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
            await self.book.change(t, TrackStatus.cancelled, finished_at=time.time(), owner=None)
        elif outcome.kind is OutcomeKind.busy:
            raise RetryTrack(f"worker {w.worker_id} was busy", count=False)
        else:
            s = self.s
            if w.track_failed(outcome.environment, s.bench_after_failures, s.bench_sec, outcome.error):
                self.kick()
            if outcome.environment and t.env_failures + 1 < s.max_attempts * max(1, len(self.pool.workers)):
                raise RetryTrack(f"worker {w.worker_id}: {outcome.error}", environment=True)
            await self.book.change(t, TrackStatus.error, error=outcome.error, finished_at=time.time(), owner=None)
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
        if exc.environment:
            t.avoid_worker, t.env_failures = w.worker_id, t.env_failures + 1
            # Past every worker's share of tries they count again: a fleet that all misbehaves ends the track.
            count = t.env_failures >= self.s.max_attempts * max(1, len(self.pool.workers))
        await self.book.retry(job, t, str(exc), count)

    async def _remove_worker_files(self, w: WorkerHandle, task_id: str | None) -> None:
        """The files are ours now: the worker may delete its copies (its age sweep is the safety net)."""
        if task_id is None:
            return
        try:
            await w.client.remove_files(task_id)
        except WorkerUnreachable as exc:
            log.info("worker %d: files of %s not removed (%s)", w.worker_id, task_id, exc)

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
                elif now > self._deadlines.get(key, math.inf):
                    self.stop(key, f"past its deadline of {self.deadline(self.book.jobs[key[0]]):.0f}s")

    # ---- what a health poll means for the attempts on a worker ----------------------------------
    async def on_health(self, w: WorkerHandle, before: WorkerView) -> None:
        """Refresh the running tracks' progress from ``w``'s health; stop them if the worker is lost."""
        for task_id, key in list(w.assigned.items()):
            job = self.book.jobs.get(key[0])
            if job is None:
                continue
            t = job.tracks[key[1]]
            take = w.progress_of(task_id) if w.online and t.status.running and t.task_id == task_id else None
            if take is not None:
                fields = {"worker_phase": take.phase, "phase_progress": int(take.progress),
                          "phase_detail": take.progress_detail, "phase_rate": take.tokens_per_sec}  # fmt: skip
                status = status_of_phase(take.phase)
                if status is not t.status:
                    if t.task_id == task_id and t.status.running:  # still this attempt's, after any await
                        await self.book.change(t, status, **fields)
                        self._progress_saved[key] = time.monotonic()
                elif self.book.show_progress(t, fields):
                    await self._save_progress(t)
            if not w.online and before is not WorkerView.offline:
                self.stop(key, f"worker {w.worker_id} went offline")
            elif w.health.status == "stalled" and before is not WorkerView.stalled:
                self.stop(key, f"worker {w.worker_id} reported its model thread stalled")

    async def _save_progress(self, t: Track) -> None:
        """Other dispatchers show a track's progress from the store: write it, at most once a second."""
        if not self.store.shared:
            return
        now = time.monotonic()
        if now - self._progress_saved.get(t.key, 0.0) >= PROGRESS_WRITE_SEC:
            self._progress_saved[t.key] = now
            await self.store.save_progress(t)

    # ---- the asyncio tasks that run attempts ----------------------------------------------------
    def _spawn(self, keys: list[Key], coro: Coroutine[Any, Any, None]) -> None:
        """One asyncio task runs one attempt of ``keys`` (several: the takes of one batch)."""
        task = asyncio.create_task(coro, name=f"track-{keys[0][0]}-{'+'.join(str(k[1]) for k in keys)}")
        for key in keys:
            self.running[key] = task
            task.add_done_callback(functools.partial(self._task_done, key))

    def _task_done(self, key: Key, task: asyncio.Task[None]) -> None:
        if self.running.get(key) is task:
            del self.running[key]
        if not task.cancelled() and task.exception() is not None:
            log.error("track %s/%d: unexpected failure", *key, exc_info=task.exception())
        self.kick()
