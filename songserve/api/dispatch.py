"""Dispatch: which worker runs which tracks, and when an attempt stops.

Builds on ``TrackBook`` (tracks.py, every transition of a track). Here: the dispatch pass (queue
order, packing a job's takes into one batch), one attempt on one worker (``_attempt``, also used to
reconcile a running track after a restart), and the reasons an attempt stops:
- one stop per attempt: offline, stall, deadline and user cancels of one attempt collapse into the
  first (``stop_attempt``); the worker-side cancel that follows is shielded from further cancels;
- every background loop is supervised (``loops.py``); an unexpected error inside an attempt is a
  retry, never a stuck track; the watchdog re-queues a track whose last change could not be stored.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import httpx

from songserve.api import queue_order
from songserve.api.artifacts import ArtifactStore
from songserve.api.loops import LoopHealth, supervised
from songserve.api.metrics import DispatcherMetrics
from songserve.api.pool import Key, WorkerHandle, WorkerPool, WorkerView
from songserve.api.states import TrackStatus
from songserve.api.store import Job, JobStore, Track
from songserve.api.tracks import RetryTrack, TrackBook
from songserve.api.views import status_of_phase
from songserve.api.worker_client import Outcome, OutcomeKind, TaskLost, WorkerUnreachable, worker_request
from songserve.settings import DispatcherSettings

log = logging.getLogger(__name__)
METADATA_KEYS = ("models", "tokens", "timings", "sample_rate", "device")


class Dispatcher(TrackBook):
    def __init__(
        self, s: DispatcherSettings, store: JobStore, artifacts: ArtifactStore, http: httpx.AsyncClient
    ) -> None:
        super().__init__(s, store, artifacts)
        self.pool = WorkerPool(s.worker_list(), http, s.health_interval, s.offline_after_failures, self._on_worker)
        self.metrics = DispatcherMetrics()
        self.metrics.watch(self)
        self.loops = LoopHealth()
        self.running: dict[Key, asyncio.Task[None]] = {}
        self._stopping: dict[Key, str] = {}  # attempts asked to stop, with the reason
        self._deadlines: dict[Key, float] = {}  # monotonic
        self._tasks: list[asyncio.Task[None]] = []
        self.accepting = True

    # ---- lifecycle ------------------------------------------------------------------------------
    async def start(self, loop_tasks: list[tuple[str, Callable[[], Awaitable[None]], float]]) -> None:
        """Restore active jobs from the store, reattach running tracks, start the loops."""
        for model, ratio in reversed(self.store.finished_work_ratios()):
            self.speed.seed(model, ratio)
        await self.pool.poll_once()
        reattach = []
        for job in self.store.active_jobs():
            self.jobs[job.job_id] = job
            for t in job.tracks:
                if t.status is TrackStatus.queued:
                    self._enqueue(job, t)
                elif t.status.running:
                    reattach.append((job, t))
            self.finish_if_done(job)
        self._reorder()
        log.info("restored %d active jobs (%d queued, %d to reconcile)", len(self.jobs), len(self.queue), len(reattach))
        for job, t in reattach:
            self._spawn([(job.job_id, t.index)], self._reattach(job, t))
        self.pool.start()
        loops = [("dispatch", self._dispatch_step, 0.0), ("watchdog", self._watchdog_step, 1.0), *loop_tasks]
        for name, step, interval in loops:
            self._tasks.append(asyncio.create_task(supervised(name, step, interval, self.loops), name=name))
        self._kick.set()

    async def drain(self, timeout: float) -> None:
        self.accepting = False
        if self.running:
            log.info("draining: waiting up to %.0fs for %d running tracks", timeout, len(self.running))
            await asyncio.wait(list(self.running.values()), timeout=timeout or None)

    async def stop(self) -> None:
        self.accepting = False
        await self.pool.stop()
        for t in self._tasks + list(self.running.values()):
            t.cancel()
        await asyncio.gather(*self._tasks, *self.running.values(), return_exceptions=True)

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
        self._kick.set()

    # ---- queue and dispatch ---------------------------------------------------------------------
    def add(self, job: Job) -> None:
        """A new job (already in the store): queue its tracks and dispatch what can start now."""
        self.jobs[job.job_id] = job
        for t in job.tracks:
            self._enqueue(job, t)
        try:
            self.dispatch_now()
        except Exception:  # the job is stored and queued: the dispatch loop tries again
            log.exception("job %s: dispatch failed; the dispatch loop will retry", job.job_id)
            self._kick.set()

    def dispatch_now(self) -> None:
        """Pair queued tracks (in queue order) with available workers.

        A worker that runs batches gets more queued takes of the same job when that finishes the
        job sooner: more tracks are queued than workers are free (``PACK_TRACKS=auto``), or always
        (``always``). Otherwise tracks spread over idle workers, one each.
        """
        if not self.accepting:
            return
        ordered = queue_order.order(self.queue.values(), self._started_counts())
        free = self.pool.available()
        taken: set[Key] = set()
        try:
            for entry in ordered:
                if not free:
                    break
                if (entry.job_id, entry.index) in taken:
                    continue
                job = self.jobs[entry.job_id]
                t = job.tracks[entry.index]
                # A track that just failed on a worker for an environment reason goes elsewhere if it can.
                w = next((w for w in free if w.worker_id != t.avoid_worker), free[0])
                free.remove(w)
                tracks = [
                    t,
                    *self._pack(job, w, len(ordered) - len(taken) - 1, len(free), taken | {(job.job_id, t.index)}),
                ]
                taken.update((job.job_id, x.index) for x in tracks)
                self._begin(job, tracks, w)
        finally:
            self._reorder()

    def _pack(self, job: Job, w: WorkerHandle, queued_after: int, free_after: int, taken: set[Key]) -> list[Track]:
        """More queued takes of ``job`` for ``w`` to run in the same batch (may be none)."""
        mode = self.s.pack_tracks
        if w.max_batch <= 1 or mode == "never" or (mode == "auto" and queued_after <= free_after):
            return []
        more = [x for x in job.tracks if x.status is TrackStatus.queued and (job.job_id, x.index) not in taken]
        room = w.max_batch - 1
        if mode == "auto":
            room = min(room, queued_after - free_after)  # leave the free workers their share
        return more[: max(0, room)]

    async def _dispatch_step(self) -> None:
        await self._kick.wait()
        self._kick.clear()
        self.dispatch_now()

    def _begin(self, job: Job, tracks: list[Track], w: WorkerHandle) -> None:
        """Start one attempt of ``tracks`` (takes of one job) on ``w``: one batch when several."""
        now = time.time()
        for t in tracks:
            key, attempt = (job.job_id, t.index), t.attempts + 1
            # Unique per try: attempts that did not count (busy, environment) must not reuse a task id.
            task_id = f"{job.job_id}-{t.index}-{attempt}-{secrets.token_hex(3)}"
            self._set(t, TrackStatus.generating, attempts=attempt, task_id=task_id, worker_id=w.worker_id, error=None,
                      started_at=now, worker_phase="backbone", phase_progress=0, phase_detail="")  # fmt: skip
            del self.queue[key]
            self.metrics.queue_wait.observe(now - (t.queued_at or job.created_at))
            w.assign(key, task_id)
            self._deadlines[key] = time.monotonic() + self._deadline(job)
            log.info("track %s/%d: attempt %d on worker %d (task %s, batch of %d)", *key, attempt, w.worker_id,
                     task_id, len(tracks))  # fmt: skip
        if job.started_at is None:
            job.started_at = now
            self.store.save_job(job, terminal=False)
        reqs = [worker_request(job, t) for t in tracks]
        keys = [(job.job_id, t.index) for t in tracks]
        self._spawn(keys, self._attempt(job, tracks, w, lambda: w.client.generate_batch(reqs)))

    def _deadline(self, job: Job) -> float:
        return self.s.deadline_base_sec + self.s.deadline_factor * job.request.duration * 60

    # ---- stopping an attempt --------------------------------------------------------------------
    def stop_attempt(self, key: Key, reason: str) -> None:
        """Ask a running attempt to stop and retry; later requests for the same attempt are no-ops."""
        task = self.running.get(key)
        if task is None or task.done() or key in self._stopping:
            return
        self._stopping[key] = reason
        log.warning("track %s/%d: %s", *key, reason)
        task.cancel(reason)

    def _on_worker(self, w: WorkerHandle, before: WorkerView) -> None:
        """Health poll result: refresh the running tracks' progress; stop them if the worker is lost."""
        for task_id, key in list(w.assigned.items()):
            job = self.jobs.get(key[0])
            if job is None:
                continue
            t = job.tracks[key[1]]
            take = w.progress_of(task_id) if w.online and t.status.running and t.task_id == task_id else None
            if take is not None:
                fields = {"worker_phase": take.phase, "phase_progress": int(take.progress),
                          "phase_detail": take.progress_detail, "phase_rate": take.tokens_per_sec}  # fmt: skip
                status = status_of_phase(take.phase)
                if status is not t.status:
                    self._set(t, status, **fields)
                elif any(getattr(t, k) != v for k, v in fields.items()):
                    for k, v in fields.items():
                        setattr(t, k, v)
                    self.changes.touch()
            if not w.online and before is not WorkerView.offline:
                self.stop_attempt(key, f"worker {w.worker_id} went offline")
            elif w.health.status == "stalled" and before is not WorkerView.stalled:
                self.stop_attempt(key, f"worker {w.worker_id} reported its model thread stalled")
        if w.available:
            self._kick.set()

    async def _watchdog_step(self) -> None:
        """No progress for stall_timeout, or past the deadline: the track goes to another worker.

        Also repairs what a failed store write left behind: a track that shows running with no
        attempt behind it goes back to the queue, a job whose tracks all ended is finished.
        """
        self._repair()
        now = time.monotonic()
        for w in self.pool.workers:
            stalled = bool(w.assigned) and now - w.last_progress_at > self.s.stall_timeout_sec
            for key in list(w.assigned.values()):
                if stalled:
                    w.stalled = True
                    self.stop_attempt(key, f"worker {w.worker_id} made no progress for {now - w.last_progress_at:.0f}s")
                elif now > self._deadlines.get(key, math.inf):
                    self.stop_attempt(key, f"past its deadline of {self._deadline(self.jobs[key[0]]):.0f}s")

    def _repair(self) -> None:
        for job in list(self.jobs.values()):
            for t in job.tracks:
                if t.status.running and (job.job_id, t.index) not in self.running:
                    self._retry(job, t, "its last state change could not be stored", count=False)
            self.finish_if_done(job)

    # ---- one attempt on one worker --------------------------------------------------------------
    async def _attempt(
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
                for task_id in task_ids:
                    await self._cancel_on_worker(w, task_id)
                raise RetryTrack(reason) from None
            except WorkerUnreachable as exc:
                w.mark_unreachable()
                raise RetryTrack(f"worker {w.worker_id} connection lost ({exc})") from None
            except TaskLost as exc:
                raise RetryTrack(str(exc)) from None
            # The worker answered: its model thread is free. Give it the next track while the
            # files are copied (a failed copy retries the track like a lost worker).
            busy = any(o.kind is OutcomeKind.busy for o in outcomes)
            for task_id in task_ids:
                w.release(task_id, answered=not busy)
            self._kick.set()
            for t, task_id, outcome in zip(tracks, task_ids, outcomes, strict=True):
                try:
                    await self._apply(job, t, w, task_id, outcome)
                except RetryTrack as exc:
                    self._retry_after(job, t, w, exc)
        except RetryTrack as exc:
            for t in tracks:
                self._retry_after(job, t, w, exc)
        except Exception as exc:
            log.exception("track %s/%d: internal error", *keys[0])
            for t in tracks:
                self._retry(job, t, f"internal error ({type(exc).__name__})")
        finally:
            for key, task_id in zip(keys, task_ids, strict=True):
                self._stopping.pop(key, None)
                self._deadlines.pop(key, None)
                w.release(task_id, answered=False)
            self._kick.set()

    def _retry_after(self, job: Job, t: Track, w: WorkerHandle, exc: RetryTrack) -> None:
        if exc.environment:
            t.avoid_worker, t.env_failures = w.worker_id, t.env_failures + 1
        self._retry(job, t, str(exc), exc.count)

    async def _cancel_on_worker(self, w: WorkerHandle, task_id: str | None) -> None:
        """Tell the worker to stop; shielded, so a shutdown arriving meanwhile does not cut it short."""
        if task_id is None:
            return
        try:
            await asyncio.shield(w.client.cancel(task_id, timeout=2))
        except WorkerUnreachable:
            pass

    async def _reattach(self, job: Job, t: Track) -> None:
        """After a restart: find out what became of a track that was running on a worker."""
        w = self.pool.by_id(t.worker_id)
        if w is None or t.task_id is None:
            self._retry(job, t, "its worker is no longer configured", count=False)
            return
        key, task_id = (job.job_id, t.index), t.task_id
        w.assign(key, task_id)
        self._deadlines[key] = time.monotonic() + self._deadline(job)

        async def outcome() -> list[Outcome]:
            while True:
                try:
                    done = await w.client.task(task_id)
                except WorkerUnreachable:
                    if not w.online:
                        raise
                    done = None
                if done is not None:
                    log.info("track %s/%d: reconciled task %s (%s)", *key, task_id, done.kind.value)
                    return [done]
                await asyncio.sleep(self.s.health_interval)

        await self._attempt(job, [t], w, outcome)

    # ---- state changes --------------------------------------------------------------------------
