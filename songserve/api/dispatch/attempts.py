"""Attempts: one attempt of a track (or of a batch of one job's takes) on one worker, top to bottom.

The story of an attempt, in the order it happens: chapters 1 and 2 below, 3 and 4 in
``attempt_ends.py`` (mixed into ``Attempts``, which holds the state).
1. Its start (``begin``): the dispatch pass's placement hands it a worker; each take gets a fresh
   task id and is claimed in the store under the worker's lease (``TrackBook.claim`` with the
   attempt's ``Fence``); the takes won are assigned to the worker and one asyncio task sends the
   request (``_spawn``: never a second for a track, so nothing else acts on a track an attempt
   holds). A retake's kept frames are read before the claim. ``reattach`` follows a track already
   running on its worker (``/tasks/{id}``) after a restart, a lease take-over or a failed write;
   ``abandon`` sends one whose worker left the pool back to the queue.
2. Its answer (``_run``): progress while it runs, from the health poll (``on_health``: a new phase is
   a state change, the rest reaches the store at most once a second); then one ``Outcome`` per take,
   the worker released at once (its next track starts while the files are copied), and each applied
   (``_apply``): done → the files copied and checked (``ArtifactStore.collect``) and the track done;
   a clear model error → error; cancelled, busy, an environment failure → a retry. Only the current
   task id's outcome is applied, so a retried track finishes once. A worker's own fault (an answer
   out of contract, files not what it said) is charged to its breaker (``_charge``) and costs no try;
   a results folder we cannot write is ours: the track waits.
3. Its stop: from outside (the watchdog, the health poll, the user, the pool, a lost lease), or after
   a failure: a retry, or the end of the track's tries.
4. Its fence: the lease every write carries, and what a write refused under it ends.

Not the story, and where it lives: each state write, store first (``tracks.py``); which failures cost
a try (``retries.py``); what a worker's answer means (``workers/outcomes.py``); the files
(``results/``); the leases and their epochs (``membership.py``).
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

from songserve.api.dispatch import retakes, retries
from songserve.api.dispatch.attempt_ends import LEASE_LOST, SILENT, TAKEN_OVER, AttemptEnds
from songserve.api.dispatch.estimates import SpeedHistory
from songserve.api.dispatch.pool import WorkerHandle, WorkerPool, WorkerView
from songserve.api.dispatch.retries import RetryTrack
from songserve.api.dispatch.tracks import TrackBook
from songserve.api.jobs.phases import status_of_phase
from songserve.api.jobs.records import Job, Key, Track
from songserve.api.jobs.states import IllegalTransition, TrackStatus
from songserve.api.metrics import DispatcherMetrics
from songserve.api.results.artifacts import ArtifactStore
from songserve.api.settings import DispatcherSettings
from songserve.api.store.members import Fence
from songserve.api.store.protocol import JobStore, LeaseLost, StaleTrack, StoreError, background_context
from songserve.api.workers.outcomes import Outcome, OutcomeKind, TaskLost, WorkerFault, WorkerUnreachable
from songserve.api.workers.to_worker import result_metadata, result_seed, worker_request

log = logging.getLogger(__name__)
PROGRESS_WRITE_SEC = 1.0  # a running track's progress reaches the store at most this often


class Attempts(AttemptEnds):
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

    # ---- 1. the start ---------------------------------------------------------------------------
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
        return self._spawn([t.key], self._conclude(job, t, self.retry(job, t, reason, count=False)))

    async def _follow(self, job: Job, t: Track) -> None:
        w = self.pool.by_id(t.worker_id)
        if w is None or t.task_id is None:
            await self._conclude(job, t, self.retry(job, t, "its worker is no longer configured", count=False))
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

    # ---- 2. the answer --------------------------------------------------------------------------
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
                await self._conclude(job, t, self.retry(job, t, f"internal error ({type(exc).__name__})",
                                                        fence=self._fences.get(t.key)))  # fmt: skip
        finally:
            for key, task_id in zip(keys, task_ids, strict=True):
                self._stopping.pop(key, None)
                self._deadlines.pop(key, None)
                self._progress_saved.pop(key, None)
                self._fences.pop(key, None)
                w.release(task_id, answered=False)
            self.kick()

    async def on_health(self, w: WorkerHandle, before: WorkerView) -> None:
        """While it runs: refresh the running tracks' progress from ``w``'s health; stop them if the
        worker is lost. A progress write refused for a lost lease stops the attempt there and then."""
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

    async def _apply_or_retry(self, job: Job, t: Track, w: WorkerHandle, task_id: str | None, outcome: Outcome) -> None:
        try:
            await self._apply(job, t, w, task_id, outcome)
        except RetryTrack as exc:
            await self._retry_after(job, t, w, exc)

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
            workers = len(self.pool.workers)
            if outcome.environment and t.env_failures + 1 < retries.environment_share(s.max_attempts, workers):
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

    async def _remove_worker_files(self, w: WorkerHandle, task_id: str | None) -> None:
        """The files are ours now: the worker may delete its copies (its age sweep is the safety net)."""
        if task_id is None:
            return
        try:
            await w.client.remove_files(task_id)
        except WorkerUnreachable as exc:
            log.info("worker %d: files of %s not removed (%s)", w.worker_id, task_id, exc)
