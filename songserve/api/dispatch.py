"""Dispatch: which worker runs which tracks, and when an attempt stops.

Builds on ``TrackBook`` (tracks.py, every transition of a track). Here: the dispatch pass (queue
order, packing a job's takes into one batch), one attempt on one worker (``_attempt``, also used to
reconcile a running track after a restart), and the reasons an attempt stops:
- one stop per attempt: offline, stall, deadline and user cancels of one attempt collapse into the
  first (``stop_attempt``); the worker-side cancel that follows is shielded from further cancels;
- every background loop is supervised (``loops.py``); an unexpected error inside an attempt is a
  retry, never a stuck track; the watchdog re-queues a track whose last change could not be stored.

Membership (``_membership_step``, every third of ``LEASE_TTL_SEC``): this dispatcher says it is
alive, renews the registration of the workers its ``WORKER_URLS`` lists, follows the registry (which
also holds announced workers), renews its worker leases and takes free or expired ones up to its
fair share (workers / live dispatchers), and hands extras back: an idle one at once, a busy one
once its tasks end (it gets no new ones meanwhile), so a dispatcher joining a fleet under
sustained load gets its share too. A worker whose lease it just took may be running tracks of
a dispatcher that died: they are reattached through the worker's ``/tasks/{id}``, as after a
restart. A lease this dispatcher lost (it stalled past the TTL) ends its attempts there silently:
the new holder owns them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
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
from songserve.api.outcomes import Outcome, OutcomeKind, TaskLost, WorkerUnreachable
from songserve.api.phases import status_of_phase
from songserve.api.pool import WorkerHandle, WorkerPool, WorkerView
from songserve.api.states import TrackStatus
from songserve.api.store import STORED_TRACK_FIELDS, Job, JobStore, Key, StaleTrack, Track, WorkerRow
from songserve.api.to_worker import worker_request
from songserve.api.tracks import RetryTrack, TrackBook
from songserve.settings import DispatcherSettings

log = logging.getLogger(__name__)
LEASE_LOST = "its worker's lease passed to another dispatcher"
PROGRESS_WRITE_SEC = 1.0  # a running track's progress reaches the store at most this often


class Dispatcher(TrackBook):
    def __init__(
        self, s: DispatcherSettings, store: JobStore, artifacts: ArtifactStore, http: httpx.AsyncClient
    ) -> None:
        super().__init__(s, store, artifacts, s.my_id())
        self.pool = WorkerPool(http, s.health_interval, s.offline_after_failures, self._on_worker)
        self.static_urls = s.worker_list()
        self.metrics = DispatcherMetrics()
        self.metrics.watch(self)
        self.loops = LoopHealth()
        self.counts: dict[str, int] = {}  # tracks by status in the store, refreshed by the membership loop
        self.alive: set[str] = {self.me}  # live dispatchers at the last membership check
        self._membership_ticks = 0
        self._membership_kick = asyncio.Event()
        self._dispatching = asyncio.Lock()
        self._progress_saved: dict[Key, float] = {}  # monotonic time of a running track's last progress write
        self._stopping: dict[Key, str] = {}  # attempts asked to stop, with the reason
        self._deadlines: dict[Key, float] = {}  # monotonic
        self._tasks: list[asyncio.Task[None]] = []
        self._exit = contextlib.AsyncExitStack()  # what start() entered, left by stop()
        self.accepting = True

    # ---- lifecycle ------------------------------------------------------------------------------
    async def start(self, loop_tasks: list[tuple[str, Callable[[], Awaitable[None]], float]]) -> None:
        """Restore active jobs from the store, take worker leases (reattaching their running tracks),
        start the loops."""
        for model, ratio in reversed(await self.store.finished_work_ratios()):
            self.speed.seed(model, ratio)
        for job in await self.store.active_jobs():
            self.jobs[job.job_id] = job
            for t in job.tracks:
                if t.status is TrackStatus.queued:
                    self._enqueue(job, t)
            await self.finish_if_done(job)
        self._reorder()
        await self._membership_step(first=True)
        log.info("dispatcher %s: %d active jobs (%d tracks queued), %d workers (%d leased here)", self.me,
                 len(self.jobs), len(self.queue), len(self.pool.workers), sum(w.leased for w in self.pool.workers))  # fmt: skip
        self.pool.start()
        loops = [
            ("dispatch", self._dispatch_step, 0.0),
            ("watchdog", self._watchdog_step, 1.0),
            ("membership", self._membership_loop_step, 0.0),
            ("store-sync", self.sync_step, 0.0),
            *loop_tasks,
        ]
        await self._exit.enter_async_context(self.store.listen(self.resync))
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
        await self._exit.aclose()  # the store's event listener
        try:  # the leases go now, so another dispatcher takes the workers (and their tracks) at once
            await self.store.leave(self.me)
        except Exception as exc:  # the store is gone: the leases expire on their own
            log.warning("dispatcher %s: could not release its leases (%s)", self.me, exc)

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
    async def add(self, job: Job) -> None:
        """A new job (already in the store): queue its tracks and dispatch what can start now."""
        self.jobs[job.job_id] = job
        for t in job.tracks:
            self._enqueue(job, t)
        try:
            await self.dispatch_now()
        except Exception:  # the job is stored and queued: the dispatch loop tries again
            log.exception("job %s: dispatch failed; the dispatch loop will retry", job.job_id)
            self._kick.set()

    async def dispatch_now(self) -> None:
        """Pair queued tracks (in queue order) with available workers (those leased here).

        A worker that runs batches gets more queued takes of the same job when that finishes the
        job sooner: more tracks are queued than workers are free (``PACK_TRACKS=auto``), or always
        (``always``). Otherwise tracks spread over idle workers, one each. Each batch is claimed in
        the store first; takes another dispatcher claimed meanwhile are skipped.
        """
        async with self._dispatching:
            await self._dispatch_pass()

    async def _dispatch_pass(self) -> None:
        if not self.accepting:
            return
        if any(w.handing_back and not w.assigned for w in self.pool.workers):
            self.membership_soon()  # its last task ended: give its lease back now, not at the next tick
        free = self.pool.available()
        if not free:  # nothing can start: only the positions change (one ordering, not two)
            self._reorder()
            return
        ordered = queue_order.order(self.queue.values(), self._started_counts())
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
                tracks = [
                    t,
                    *self._pack(job, w, len(ordered) - len(taken) - 1, len(free) - 1, taken | {(job.job_id, t.index)}),
                ]
                taken.update((job.job_id, x.index) for x in tracks)
                if await self._begin(job, tracks, w):
                    free.remove(w)
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
        await self.dispatch_now()

    async def _begin(self, job: Job, tracks: list[Track], w: WorkerHandle) -> bool:
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
        async with self._write:
            won = await self.store.claim(wanted)
            for t, new in zip(tracks, wanted, strict=True):
                self.queue.pop(t.key, None)
                if t.index in won:
                    for name in STORED_TRACK_FIELDS:
                        setattr(t, name, getattr(new, name))
        self.changes.touch()
        if len(won) < len(tracks):
            self.resync(job.job_id)  # another dispatcher took some: learn their state
        started = [t for t in tracks if t.index in won]
        if not started:
            return False
        for t in started:
            self.metrics.queue_wait.observe(now - (t.queued_at or job.created_at))
            w.assign(t.key, t.task_id or "")
            self._deadlines[t.key] = time.monotonic() + self._deadline(job)
            log.info("track %s/%d: attempt %d on worker %d (task %s, batch of %d)", *t.key, t.attempts, w.worker_id,
                     t.task_id, len(started))  # fmt: skip
        reqs = [worker_request(job, t) for t in started]
        self._spawn([t.key for t in started], self._attempt(job, started, w, lambda: w.client.generate_batch(reqs)))
        if job.started_at is None:
            job.started_at = now
            await self.store.mark_started(job.job_id, now)
        return True

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

    async def _on_worker(self, w: WorkerHandle, before: WorkerView) -> None:
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
                    if t.task_id == task_id and t.status.running:  # still this attempt's, after any await
                        await self._set(t, status, **fields)
                        self._progress_saved[key] = time.monotonic()
                elif any(getattr(t, k) != v for k, v in fields.items()):
                    for k, v in fields.items():
                        setattr(t, k, v)
                    self.changes.touch()
                    await self._save_progress(t)
            if not w.online and before is not WorkerView.offline:
                self.stop_attempt(key, f"worker {w.worker_id} went offline")
            elif w.health.status == "stalled" and before is not WorkerView.stalled:
                self.stop_attempt(key, f"worker {w.worker_id} reported its model thread stalled")
        if w.available:
            self._kick.set()

    async def _save_progress(self, t: Track) -> None:
        """Other dispatchers show a track's progress from the store: write it, at most once a second."""
        if not self.store.shared:
            return
        now = time.monotonic()
        if now - self._progress_saved.get(t.key, 0.0) >= PROGRESS_WRITE_SEC:
            self._progress_saved[t.key] = now
            await self.store.save_progress(t)

    def on_cancelled(self, key: Key) -> None:
        self.stop_attempt(key, "cancelled by the user")

    async def _watchdog_step(self) -> None:
        """No progress for stall_timeout, or past the deadline: the track goes to another worker.

        Also repairs what a failed store write left behind: a track that shows running with no
        attempt behind it goes back to the queue, a job whose tracks all ended is finished.
        """
        await self._repair()
        now = time.monotonic()
        for w in self.pool.workers:
            stalled = bool(w.assigned) and now - w.last_progress_at > self.s.stall_timeout_sec
            for key in list(w.assigned.values()):
                if stalled:
                    w.stalled = True
                    self.stop_attempt(key, f"worker {w.worker_id} made no progress for {now - w.last_progress_at:.0f}s")
                elif now > self._deadlines.get(key, math.inf):
                    self.stop_attempt(key, f"past its deadline of {self._deadline(self.jobs[key[0]]):.0f}s")

    async def _repair(self) -> None:
        """Tracks this dispatcher owns that show running with no attempt behind it go back to the queue
        (unless their worker is leased elsewhere now: its new holder takes them over)."""
        for job in list(self.jobs.values()):
            for t in job.tracks:
                if t.status.running and t.owner == self.me and t.key not in self.running:
                    w = self.pool.by_id(t.worker_id)
                    if w is not None and not w.leased and w.lease_owner not in (None, self.me):
                        continue
                    with contextlib.suppress(StaleTrack):
                        await self._retry(job, t, "its last state change could not be stored", count=False)
            await self.finish_if_done(job)

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
                if reason == LEASE_LOST:  # the worker's new holder reattaches these tasks: leave them be
                    return
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
                    await self._retry_after(job, t, w, exc)
        except RetryTrack as exc:
            for t in tracks:
                await self._retry_after(job, t, w, exc)
        except StaleTrack as exc:
            log.warning("track %s/%d: another dispatcher took it over", *exc.key)
        except Exception as exc:
            log.exception("track %s/%d: internal error", *keys[0])
            for t in tracks:
                await self._retry(job, t, f"internal error ({type(exc).__name__})")
        finally:
            for key, task_id in zip(keys, task_ids, strict=True):
                self._stopping.pop(key, None)
                self._deadlines.pop(key, None)
                self._progress_saved.pop(key, None)
                w.release(task_id, answered=False)
            self._kick.set()

    async def _retry_after(self, job: Job, t: Track, w: WorkerHandle, exc: RetryTrack) -> None:
        if exc.environment:
            t.avoid_worker, t.env_failures = w.worker_id, t.env_failures + 1
        await self._retry(job, t, str(exc), exc.count)

    async def _cancel_on_worker(self, w: WorkerHandle, task_id: str | None) -> None:
        """Tell the worker to stop; shielded, so a shutdown arriving meanwhile does not cut it short."""
        if task_id is None:
            return
        try:
            await asyncio.shield(w.client.cancel(task_id, timeout=2))
        except WorkerUnreachable:
            pass

    async def _reattach(self, job: Job, t: Track) -> None:
        """After a restart or a lease takeover: find out what became of a track running on a worker."""
        w = self.pool.by_id(t.worker_id)
        if w is None or t.task_id is None:
            await self._retry(job, t, "its worker is no longer configured", count=False)
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

    # ---- membership: presence, the worker registry, leases --------------------------------------
    async def _membership_loop_step(self) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._membership_kick.wait(), self.s.lease_ttl_sec / 3)
        self._membership_kick.clear()
        await self._membership_step()

    def membership_soon(self) -> None:
        """A worker announced itself or left: look at the registry now, not at the next tick."""
        self._membership_kick.set()

    async def _membership_step(self, first: bool = False) -> None:
        store, ttl = self.store, self.s.lease_ttl_sec
        self.alive = await store.heartbeat(self.me, ttl)
        for url in self.static_urls:  # each dispatcher keeps the workers it is configured with registered
            await store.register_worker(url, max(3 * ttl, 15.0), announced=False)
        rows = await store.live_workers()
        joined, left = self.pool.sync(rows)
        for w in left:
            for key in list(w.assigned.values()):
                self.stop_attempt(key, f"worker {w.worker_id} left the pool")
        if joined and not first:
            await asyncio.gather(*(self.pool.poll(w) for w in joined))
        held = await store.renew_leases(self.me, ttl)
        for w in self.pool.workers:
            if w.leased and w.worker_id not in held:
                # Expired while this dispatcher was slow: still ours unless another took it meanwhile.
                if await store.acquire_lease(self.me, w.worker_id, ttl):
                    held.add(w.worker_id)
                else:
                    self._lease_lost(w)
        taken = await self._take_leases(held, rows)
        for w in self.pool.workers:
            w.leased = w.worker_id in held
            if w.leased:
                w.lease_owner = self.me
            else:
                w.handing_back = False
        if first:
            await self.pool.poll_once()
        # At start, every worker leased here may run tracks of this dispatcher's previous life.
        await self._take_over([w for w in self.pool.workers if w.leased] if first else taken)
        await self._orphans({r.worker_id for r in rows})
        self._membership_ticks += 1
        if store.shared and self._membership_ticks % 5 == 0:
            self.resync("*")  # a safety net under the events
        self.counts = await store.counts()
        self._kick.set()

    async def _take_leases(self, held: set[int], rows: list[WorkerRow]) -> list[WorkerHandle]:
        """Take free or expired leases up to this dispatcher's fair share; hand extras back (an idle
        one now, a busy one once its tasks end: it is marked ``handing_back`` and gets no new ones)."""
        share = math.ceil(len(rows) / max(1, len(self.alive)))
        taken = []
        for r in rows:
            if len(held) >= share:
                break
            if r.worker_id in held or r.lease_owner not in (None, self.me):
                continue
            if await self.store.acquire_lease(self.me, r.worker_id, self.s.lease_ttl_sec):
                held.add(r.worker_id)
                if (w := self.pool.by_id(r.worker_id)) is not None:
                    taken.append(w)
                    log.info("worker %d (%s): leased by %s", w.worker_id, w.url, self.me)
        extra = len(held) - share if len(self.alive) > 1 else 0
        mine = [w for w in self.pool.workers if w.worker_id in held]
        for w in sorted(mine, key=lambda w: (bool(w.assigned), w.worker_id)):  # idle ones go first
            if extra <= 0:
                w.handing_back = False
                continue
            extra -= 1
            if w.assigned:
                if not w.handing_back:
                    log.info("worker %d: lease goes back once its tasks end (fair share %d of %d dispatchers)",
                             w.worker_id, share, len(self.alive))  # fmt: skip
                w.handing_back = True
                continue
            await self.store.release_lease(self.me, w.worker_id)
            held.discard(w.worker_id)
            w.handing_back = False
            log.info("worker %d: lease given back (fair share %d of %d dispatchers)", w.worker_id, share,
                     len(self.alive))  # fmt: skip
        return taken

    def _lease_lost(self, w: WorkerHandle) -> None:
        log.warning("worker %d: lease lost (this dispatcher stalled past LEASE_TTL_SEC?)", w.worker_id)
        w.leased = False
        for key in list(w.assigned.values()):
            self.stop_attempt(key, LEASE_LOST)

    async def _take_over(self, workers: list[WorkerHandle]) -> None:
        """Reattach the tracks running on workers just leased here (their dispatcher died or restarted)."""
        for w in workers:
            for key in await self.store.running_on(w.worker_id):
                if key in self.running:
                    continue
                self.merge(key[0], await self.store.load_job(key[0]))
                job = self.jobs.get(key[0])
                t = job.tracks[key[1]] if job is not None else None
                if job is None or t is None or not t.status.running or t.worker_id != w.worker_id:
                    continue
                try:
                    await self._set(t, t.status, owner=self.me)
                except StaleTrack:
                    continue
                log.info("track %s/%d: taking over task %s on worker %d", *key, t.task_id, w.worker_id)
                self._spawn([key], self._reattach(job, t))

    async def _orphans(self, live: set[int]) -> None:
        """Running tracks on a worker gone from the registry, owned here or by a dead dispatcher: retry."""
        for job in list(self.jobs.values()):
            for t in job.tracks:
                if not t.status.running or t.key in self.running or t.worker_id in live:
                    continue
                if t.owner == self.me or t.owner not in self.alive:
                    with contextlib.suppress(StaleTrack):
                        await self._retry(job, t, "its worker is no longer in the pool", count=False)
