"""The dispatcher: which worker runs which tracks, put together from the parts that do the work.

It holds these parts, each given what it needs when it is made; no part inherits from another or
sets another's attributes (they read each other's state and call each other's methods):
- the track book (``tracks.py``): the active jobs, the queue, every transition of a track;
- the worker pool (``pool.py``): the workers and the health poll;
- the attempts (``attempts.py``): one record per running track, and its start, answer, stop and fence;
- the membership (``membership.py``): presence, the worker registry, leases and take-overs;
- the encodings (``encodings.py``): uploads to encode, served before tracks.

Here: the loops that drive them (dispatch, watchdog, membership, reconcile, store sync, the store
probe, the results folder's probe; each supervised, see ``loops.py``, and all on the store's
background lane: their own connections), the dispatch pass (the facts gathered, ``placement.plan``
asked, its assignments started), the watchdog's repair of what a failed store write left behind (by
asking the worker, never by guessing), and the few methods ``JobService`` calls: ``add``, ``cancel``, ``active_job``,
``facts``, ``queue_position``, ``fleet``, admission (``queue_length``, ``queue_wait``,
``free_workers``), ``status`` and ``ready`` (answered by ``readiness.py`` from these parts' states).
The gauges of ``metrics.py`` read the ``LiveState`` methods at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping

from songserve.api.dispatch import readiness
from songserve.api.dispatch.attempts import USER_CANCEL, Attempts
from songserve.api.dispatch.encodings import Encodings
from songserve.api.dispatch.estimates import SpeedHistory
from songserve.api.dispatch.loops import LoopHealth, SharedPasses, supervised
from songserve.api.dispatch.membership import Membership
from songserve.api.dispatch.placement import NO_WORKER, RESULTS_UNWRITABLE, PlanFacts, plan, repaints
from songserve.api.dispatch.pool import WorkerHandle, WorkerPool, WorkerView
from songserve.api.dispatch.queue_order import QueueEntry
from songserve.api.dispatch.tracks import ChangeFeed, TrackBook
from songserve.api.jobs.facts import Fleet, JobFacts, Waiting
from songserve.api.jobs.records import Job, Key
from songserve.api.jobs.states import JobStatus, job_status
from songserve.api.metrics import DispatcherMetrics
from songserve.api.results.artifacts import ArtifactStore
from songserve.api.settings import DispatcherSettings
from songserve.api.store.probe import PROBE_INTERVAL_SEC, StoreProbe
from songserve.api.store.protocol import BACKGROUND, JobStore, StoreError
from songserve.api.webhooks.events import JobEvents
from songserve.api.workers.client import WorkerClient, WorkerHttp

log = logging.getLogger(__name__)
Loop = tuple[str, Callable[[], Awaitable[None]], float]  # name, one iteration, seconds between iterations


class Dispatcher:
    def __init__(
        self,
        s: DispatcherSettings,
        store: JobStore,
        artifacts: ArtifactStore,
        http: WorkerHttp,
        events: JobEvents | None = None,
    ) -> None:
        self.s = s
        self.store = store
        self.results = artifacts.folder  # whether the results folder can be written now
        self.me = s.my_id()  # this dispatcher's id: the owner written on the tracks it runs
        self.started_at = time.time()
        self.accepting = True
        self._drained = False  # drain() runs once
        self.metrics = DispatcherMetrics()
        self.loops = LoopHealth()
        self.speed = SpeedHistory()
        self.counts: dict[str, int] = {}  # tracks by status in the store, refreshed by the membership loop
        self._kick = asyncio.Event()  # something changed that may let a track start
        self.pool = WorkerPool(http, s.health_interval, s.offline_after_failures, self._on_worker)
        self.book = TrackBook(store, self.me, self.metrics, events)
        self.attempts = Attempts(
            s, self.me, store, self.book, self.pool, artifacts, self.metrics, self.speed, self._kick.set
        )
        self.membership = Membership(s, self.me, store, self.pool, self.book, self.attempts)
        self.encodings = Encodings(s, self.me, store, artifacts, self.attempts, self._kick.set)
        self.probe = StoreProbe(store)
        self.metrics.watch(self)
        self._membership_ticks = 0
        self._passes = SharedPasses(self._dispatch_pass)  # one pass at a time, shared by the calls waiting for it
        self._tasks: list[asyncio.Task[None]] = []
        self._exit = contextlib.AsyncExitStack()  # what start() entered, left by stop()

    # ---- lifecycle ------------------------------------------------------------------------------
    async def start(self, loop_tasks: list[Loop]) -> None:
        """Restore active jobs from the store, take worker leases (reattaching their running tracks),
        start the loops."""
        book = self.book
        for model, ratio in reversed(await self.store.finished_work_ratios()):
            self.speed.seed(model, ratio)
        for job in await self.store.active_jobs():
            book.add(job)
            await book.finish_if_done(job)
        book.reorder()
        await self._membership_step(first=True)
        await self._reconcile_step()
        active = sum(any(t.status.running for t in j.tracks) for j in book.jobs.values())  # as /status counts
        log.info(
            "dispatcher %s: %d unfinished jobs (%d active, %d tracks queued), %d workers (%d leased here)",
            self.me,
            len(book.jobs),
            active,
            len(book.queue),
            len(self.pool.workers),
            sum(w.leased for w in self.pool.workers),
        )
        loops = [
            ("dispatch", self._dispatch_step, 0.0),
            ("watchdog", self._watchdog_step, 1.0),
            ("membership", self._membership_loop_step, 0.0),
            ("reconcile", self._reconcile_step, 0.0),
            ("store-sync", self._sync_step, 0.0),
            ("results-folder", self._results_step, 1.0),
            ("store-probe", self.probe.step, PROBE_INTERVAL_SEC),
            *loop_tasks,
        ]
        lane = BACKGROUND.set(True)  # what starts here uses the loops' own store connections
        try:
            self.pool.start()
            await self._exit.enter_async_context(self.store.listen(book.resync))
            for name, step, interval in loops:
                # The membership retries within a third of a lease: else the leases lapse.
                cap = self.s.lease_ttl_sec / 3 if name in ("membership", "reconcile") else None
                task = asyncio.create_task(supervised(name, step, interval, self.loops, max_backoff=cap), name=name)
                self._tasks.append(task)
        finally:
            BACKGROUND.reset(lane)
        self._kick.set()

    async def drain(self, timeout: float) -> None:
        """Once: the signal's drain and the lifespan's end both ask, and a drain that ran out of time is
        over (the second would wait as long again and say so again)."""
        self.accepting = False
        if self._drained:
            return
        self._drained = True
        running = {key: a.task for key, a in self.attempts.running.items()}  # the takes of a batch share one task
        if running:
            log.info("draining: waiting up to %.0fs for %s", timeout, _tracks(len(running), "running "))
            left = set(running.values())
            if timeout > 0:  # 0 waits for none (it once became asyncio.wait's None: without end)
                _, left = await asyncio.wait(left, timeout=timeout)
            if left:
                n = sum(task in left for task in running.values())
                said = "is" if n == 1 else "are"
                log.info("drained: %s still running %s picked up again at the next start", _tracks(n), said)
            else:
                log.info("drained: every running track finished and was collected")

    async def stop(self) -> None:
        self.accepting = False
        await self.pool.stop()
        await self.encodings.stop()
        tasks = self._tasks + list({a.task for a in self.attempts.running.values()})
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._exit.aclose()  # the store's event listener
        await self.membership.leave()

    # ---- the loops ------------------------------------------------------------------------------
    async def _dispatch_step(self) -> None:
        await self._kick.wait()
        self._kick.clear()
        await self.dispatch_now()

    async def _on_worker(self, w: WorkerHandle, before: WorkerView) -> None:
        """Health poll result: the attempts there learn of it; a worker that can take a track is used."""
        await self.attempts.on_health(w, before)
        if w.available:
            self._kick.set()

    async def _watchdog_step(self) -> None:
        """Stalled or overdue attempts stop (``Attempts.watch``), after repairing what a failed store
        write left behind: a track that shows running with no attempt behind it goes back to the
        queue, a job whose tracks all ended is finished."""
        await self._repair()
        self.attempts.watch()

    async def _repair(self) -> None:
        """A track running here with no attempt behind it (its outcome could not be stored) is asked
        about at its worker (``/tasks/{id}``): collected if finished, awaited if running, re-queued only
        if lost. Only under a lease held here (elsewhere: the holder took it over; a worker gone from the
        pool: the membership's orphan). Then a job whose tracks all ended is finished."""
        for job in list(self.book.jobs.values()):
            for t in job.tracks:
                if t.status.running and t.owner == self.me and t.key not in self.attempts.running:
                    w = self.pool.by_id(t.worker_id)
                    if w is not None and w.leased and w.lease_epoch and self.attempts.reattach(job, t):
                        log.info(
                            "track %s/%d: no attempt behind it; asking worker %d about task %s",
                            *t.key,
                            w.worker_id,
                            t.task_id,
                        )
            try:
                await self.book.finish_if_done(job)
            except StoreError as exc:  # the next tick tries again
                log.warning("job %s: could not be finished in the store (%s)", job.job_id, exc)

    async def _membership_loop_step(self) -> None:
        await self.membership.wait()
        await self._membership_step()

    async def _membership_step(self, first: bool = False) -> None:
        await self.membership.step(first)
        self._membership_ticks += 1
        if self.store.shared and self._membership_ticks % 5 == 0:
            self.book.resync("*")  # a safety net under the events
        self._kick.set()

    async def _results_step(self) -> None:
        """Probe the results folder; when it can be written again, queued tracks may start."""
        before = self.results.writable
        await self.results.step()
        if self.results.writable and not before:
            self._kick.set()

    async def _reconcile_step(self) -> None:
        """After each membership step: its work on the job tables, then the gauges' track counts."""
        await self.membership.reconcile()
        await self.encodings.reconcile(self.membership.alive)
        self._kick.set()
        self.counts = await self.store.counts()

    async def _sync_step(self) -> None:
        """Follow the shared store; this dispatcher's attempts of a job cancelled elsewhere stop."""
        for key in await self.book.sync(self.attempts.running):
            self.attempts.stop(key, USER_CANCEL)
        self._kick.set()

    # ---- dispatch -------------------------------------------------------------------------------
    async def dispatch_now(self) -> None:
        """Pair queued tracks (in queue order) with available workers (those leased here).

        A worker that runs batches gets more queued takes of the same job when that finishes the
        job sooner: more tracks are queued than workers are free (``PACK_TRACKS=auto``), or always
        (``always``). Otherwise tracks spread over idle workers, one each. Each batch is claimed in
        the store first; takes another dispatcher claimed meanwhile are skipped.

        Its store calls go in the background lane wherever it is called from (a submission's route
        too): the attempts it starts write there, and a job's start must be stored before its tracks'
        ends, which a route's place in the store's queue would not keep.

        One pass runs at a time, and one pass answers every call made before it began (``SharedPasses``):
        a burst of submissions waits for the pass under way and one more, not for a pass each.
        """
        lane = BACKGROUND.set(True)
        try:
            await self._passes()
        finally:
            BACKGROUND.reset(lane)

    async def _dispatch_pass(self) -> None:
        """Gather the facts, plan (``placement.plan``: pure), apply the plan (start its attempts). A
        claim another dispatcher won leaves its worker free: the rest of the queue is planned again for
        it, without the tracks this pass already tried."""
        if not self.accepting:
            return
        book = self.book
        if any(
            w.handing_back and not w.assigned and not self.attempts.fenced_on(w.worker_id) for w in self.pool.workers
        ):
            self.membership.soon()  # its last task ended: give its lease back now, not at the next tick
        now = time.monotonic()
        if any(w.leased and now >= w.lease_valid_until for w in self.pool.workers):
            self.membership.soon()  # a lease not renewed in time (a pause?): nothing goes there until it is
        # No new track while the results folder cannot be written: its files would only wait too.
        free = self.pool.available() if self.results.writable else []
        if free:  # short work first: uploads waiting for their codes
            free = await self.encodings.start(free)
        if not free:  # nothing can start: only the positions change (one ordering, not two)
            book.waiting = Waiting(otherwise=NO_WORKER if self.results.writable else RESULTS_UNWRITABLE)
            book.reorder()
            return
        ordered = book.ordered()
        try:
            facts = PlanFacts(self.s.pack_tracks, self.pool.workers, await self._frames(ordered))
            tried: set[Key] = set()
            reasons: dict[Key, str] = {}
            while free:
                p = plan(ordered, book.jobs, book.queue, free, facts, tried)
                reasons.update(p.waiting)
                book.waiting = Waiting(reasons)
                lost = False
                for a in p.assignments:
                    tried.update(a.keys)
                    # The claims below await: a worker the plan chose may have moved meanwhile.
                    if a.worker.available and await self.attempts.begin(a.job, a.tracks, a.worker, a.missing):
                        free.remove(a.worker)
                    else:
                        lost = True
                if not lost:
                    break
                free = [w for w in free if w.available]
        finally:
            book.reorder()

    async def _frames(self, ordered: list[QueueEntry]) -> dict[str, str | None]:
        """For each queued job that continues an upload: whether its kept frames are cut (``Encodings.frames_for``)."""
        frames: dict[str, str | None] = {}
        for e in ordered:
            job = self.book.jobs.get(e.job_id)
            if job is not None and e.job_id not in frames and job.request.continue_from is not None:
                frames[e.job_id] = await self.encodings.frames_for(job)
        return frames

    # ---- what the service asks ------------------------------------------------------------------
    @property
    def changes(self) -> ChangeFeed:
        """Bumped on every visible change (SSE streams wait on it)."""
        return self.book.changes

    async def add(self, job: Job) -> None:
        """A new job (already in the store): queue its tracks and dispatch what can start now."""
        self.book.add(job)
        try:
            await self.dispatch_now()
        except Exception:  # the job is stored and queued: the dispatch loop tries again
            log.exception("job %s: dispatch failed; the dispatch loop will retry", job.job_id)
            self._kick.set()

    async def cancel(self, job: Job) -> None:
        """The user cancels an unfinished job: its queued tracks end now, its running ones stop on
        their workers (at another dispatcher too: it sees the store's mark)."""
        await self.store.mark_cancelled(job.job_id)  # any dispatcher running its tracks stops them on this
        job.cancelled = True
        if job.job_id not in self.book.jobs:  # not in this dispatcher's view yet (just submitted elsewhere)
            self.book.merge(job.job_id, job, self.attempts.running)  # nothing of it runs here: nothing to stop
        await self.book.cancel_queued(job)
        running = [t for t in job.tracks if t.status.running]
        log.info("job %s: cancel (%s)", job.job_id, _tracks(len(running), "running "))
        await self.attempts.cancel_running(running)
        await self.book.finish_if_done(job)
        self.book.changes.touch()

    def active_job(self, job_id: str) -> Job | None:
        """The job, if it is active in this dispatcher's view (else only the store has it)."""
        return self.book.jobs.get(job_id)

    def facts(self, job: Job) -> JobFacts:
        positions = self.book.positions
        eta = self.speed.job_eta(job, positions, self.pool.online_count()) if job.job_id in self.book.jobs else None
        return JobFacts(positions, eta, self.book.waiting)

    def queue_position(self, job: Job) -> int:
        """The best queue position of the job's queued tracks (0: none is queued)."""
        pos = [p for t in job.tracks if (p := self.book.positions.get((job.job_id, t.index)))]
        return min(pos) if pos else 0

    def queue_wait(self) -> float:
        """A Retry-After for a full queue, in seconds."""
        return self.speed.queue_wait(len(self.book.queue), self.pool.online_count())

    def free_workers(self) -> int:
        """Workers that would take a track now."""
        return len(self.pool.available())

    def fleet(self) -> Fleet:
        pool = self.pool
        models = pool.models("backbone"), pool.models("superres")
        return Fleet(
            *models, pool.context_minutes(), len(pool.workers), pool.untrained(), pool.on_cpu(), pool.adapters()
        )

    def kick(self) -> None:
        """Something may start now (an upload was stored): the dispatch loop looks at once."""
        self._kick.set()

    def can_continue(self) -> bool:
        """Some worker can run a retake: one of ours (a reference worker knows no prefix), or none known yet."""
        return not self.pool.workers or any(not w.client.reference for w in self.pool.workers)

    def can_repaint_parts(self, parts: int) -> bool:
        """Some worker can repaint ``parts`` parts in one take: one of ours that says so in its ``/config``,
        or one of ours whose ``/config`` is not read yet, or none known yet."""
        return repaints(self.pool.workers, parts)

    def live_client(self, worker_id: int) -> WorkerClient | None:
        """Where a running track's live audio comes from: our worker's client (a reference worker makes none)."""
        w = self.pool.by_id(worker_id)
        return w.client if w is not None and not w.client.reference else None

    def knows_worker(self, worker_id: int) -> bool:
        return self.pool.by_id(worker_id) is not None

    def membership_soon(self) -> None:
        """A worker announced itself or left: look at the registry now, not at the next tick."""
        self.membership.soon()

    async def status(self) -> dict[str, object]:
        return await readiness.status(self)

    def ready(self) -> tuple[bool, str]:
        """Ready to serve, or not and why (``readiness.py``: the store, the loops, the results folder,
        the workers)."""
        return readiness.ready(self)

    def workers_ready(self) -> int:
        return readiness.workers_ready(self.pool)

    # ---- live state, for the gauges (metrics.LiveState) -----------------------------------------
    def queue_length(self) -> int:
        return len(self.book.queue)

    def running_tracks(self) -> int:
        return len(self.attempts.running)

    def stored_counts(self) -> Mapping[str, int]:
        return self.counts  # refreshed by the membership loop (a scrape never waits on the store)

    def active_job_statuses(self) -> Iterable[JobStatus]:
        return [job_status((t.status for t in job.tracks), job.cancelled) for job in self.book.jobs.values()]

    def worker_views(self) -> Iterable[tuple[int, WorkerView]]:
        return [(w.worker_id, w.view) for w in self.pool.workers]

    def loop_health(self) -> LoopHealth:
        return self.loops

    def seconds_per_audio_second(self) -> float | None:
        return self.speed.ratio()


def _tracks(n: int, kind: str = "") -> str:
    """``n`` tracks in a log line: "1 running track", "3 running tracks"."""
    return f"{n} {kind}track{'' if n == 1 else 's'}"
