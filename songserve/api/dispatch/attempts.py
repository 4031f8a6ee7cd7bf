"""Attempts: one attempt of a track (or of a batch of one job's takes) on one worker, top to bottom.

An attempt is one record (``Attempt``: its worker, task id, fence, deadline, stop reason, asyncio task,
when its progress was last stored, whether its files are being copied), held in one map keyed by
track (``Attempts.running``) from its start until its asyncio task ends. Its story, in the order it
happens:
1. Its start (``begin``): the dispatch pass's plan hands it a worker; each take gets a fresh task id
   and is claimed in the store under the worker's lease (``TrackBook.claim`` with the attempt's
   ``Fence``); the takes won are assigned to the worker and one asyncio task sends the request
   (``_spawn``: never a second for a track, so nothing else acts on a track an attempt holds). A
   retake's kept frames are read before the claim. ``reattach`` follows a track already running on
   its worker (``/tasks/{id}``) after a restart, a lease take-over or a failed write; ``abandon``
   sends one whose worker left the pool back to the queue.
2. Its answer (``_run``): progress while it runs, from the health poll (``on_health``: a new phase is
   a state change, the rest reaches the store at most once a second); then one ``Outcome`` per take,
   the worker released at once (its next track starts while the files are copied), and each applied
   (``_apply``). What the answer means for the track is ``retries.next_state``'s (pure): done → the
   files copied and checked (``ArtifactStore.collect``) and the track done; a clear model error →
   error; cancelled, busy, an environment failure → a retry. Only the current task id's outcome is
   applied, so a retried track finishes once. A worker's own fault (an answer out of contract, files
   not what it said) is charged to its breaker (``_charge``) and costs no try; a results folder we
   cannot write is ours: the track waits.
3. Its stop. From outside, once per attempt (``stop``; later stops of the same attempt are no-ops):
   the watchdog (no progress for ``STALL_TIMEOUT_SEC``, past its deadline: ``watch``), the health
   poll (its worker went offline or stalled: ``on_health``), the user's cancel (``cancel_running``),
   its worker leaving the pool, its lease lost. The attempt's own task then cancels the task on the
   worker (shielded from further cancels: ``_cancel_on_worker``) and turns the stop into a retry.
   From inside, every failure on the way is a retry of the tracks it touched (``RetryTrack``,
   ``_retry_after``): the track is not sent back to the worker that failed it while another can take
   it, and ``retries.next_state`` gives it its next state: cancelled if its job was, an error when
   its tries ran out, else queued again; ``_end`` writes it.
4. Its fence. Every write an attempt makes for its tracks carries the lease it was claimed under
   (``Attempt.fence``: this dispatcher, the worker, the lease's epoch; the worker is told it too,
   ``lease_header``, and refuses a task sent under an older one: ``worker/fence.py``). A write
   refused for a lost lease (``LeaseLost``) or for a track another dispatcher changed first
   (``StaleTrack``) ends this dispatcher's part without touching the track, as do the silent stops
   (``SILENT``): the lease's holder takes it over with the worker. No error escapes the handling of
   an answer (``_conclude``): an outcome the store could not take leaves the track running here, for
   the watchdog's repair to ask the worker again. The membership asks here whether a lease may be
   given back (``fenced_on``) and moves the attempts onto a lease it re-took unchanged (``refence``).

Not the story, and where it lives: each state write, store first (``tracks.py``); which failures cost
a try (``retries.py``); what a worker's answer means (``workers/outcomes.py``); the files
(``results/``); the leases and their epochs (``membership.py``); the worker's own fields (``pool.py``:
asked through its methods).
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
from dataclasses import dataclass
from typing import Any

from songserve.api.dispatch import retakes, retries
from songserve.api.dispatch.estimates import SpeedHistory
from songserve.api.dispatch.pool import WorkerHandle, WorkerPool, WorkerView
from songserve.api.dispatch.retries import Next, NextState, RetryTrack, Tries
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
from songserve.errors import SongserveError
from songserve.schemas import WorkerGenerateResult

log = logging.getLogger(__name__)
PROGRESS_WRITE_SEC = 1.0  # a running track's progress reaches the store at most this often
LEASE_LOST = "its worker's lease passed to another dispatcher"
TAKEN_OVER = "another dispatcher changed it first"
SILENT = (LEASE_LOST, TAKEN_OVER)  # stops that end an attempt without touching its tracks
USER_CANCEL = "cancelled by the user"
IDLE: dict[str, object] = {
    "worker_phase": "idle",
    "phase_progress": 0,
    "phase_detail": "",
    "phase_rate": None,
    "preview_sec": 0.0,
}


@dataclass
class Attempt:
    """One attempt of one track, as this dispatcher runs it (the takes of a batch share its ``task``)."""

    worker_id: int
    task_id: str | None
    task: asyncio.Task[None]  # the asyncio task that runs it
    fence: Fence | None = None  # the lease its writes are made under (None: not on a worker leased here)
    deadline: float = math.inf  # monotonic: past it, the watchdog stops it
    stop_reason: str | None = None  # asked to stop, and why (the first reason wins)
    progress_saved_at: float = 0.0  # monotonic: its progress last written to the store
    collecting: bool = False  # its files are being copied (or wait for the results folder)


class Attempts:
    """This dispatcher's attempts (``running``, by track): how each starts, goes, stops and is fenced."""

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
        self.running: dict[Key, Attempt] = {}  # this dispatcher's attempts, by track, until their task ends

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
            wanted.append(
                dataclasses.replace(
                    t,
                    status=TrackStatus.generating,
                    attempts=attempt,
                    task_id=task_id,
                    worker_id=w.worker_id,
                    owner=self.me,
                    error=None,
                    started_at=now,
                    worker_phase="backbone",
                    phase_progress=0,
                    phase_detail="",
                    phase_rate=None,
                    preview_sec=0.0,
                )
            )
        # A retake's kept frames, read before the claim: from the claim to ``_spawn`` nothing awaits.
        retake = job.request.continue_from is not None and not missing
        prefix = await retakes.kept_frames(self.artifacts, job) if retake else None
        fence = self.fence_of(w)
        if fence is None:
            return False
        try:
            started = await self.book.claim(job, tracks, wanted, fence)
        except LeaseLost:
            log.warning(
                "worker %d: %s is not held here any more; no track sent (job %s)", w.worker_id, fence, job.job_id
            )
            w.suspend_lease()  # not used again before the membership reads its leases
            return False
        if not started:
            return False
        reqs, lease = [worker_request(job, t, prefix) for t in started], self.lease_header(fence)
        if job.request.continue_from is not None and prefix is None:  # never a take of the prompt alone instead
            obtain: Callable[[], Awaitable[list[Outcome]]] = retakes.frames_gone(len(started), missing)
        else:
            obtain = functools.partial(w.client.generate_batch, reqs, lease)
        deadline = time.monotonic() + self.time_allowed(job)
        if not self._spawn(started, w.worker_id, self._run(job, started, w, obtain), fence, deadline):
            return False
        for t in started:
            self.metrics.queue_wait.observe(now - (t.queued_at or job.created_at))
            w.assign(t.key, t.task_id or "")
            log.info(
                "track %s/%d: attempt %d on worker %d (task %s, batch of %d)",
                *t.key,
                t.attempts,
                w.worker_id,
                t.task_id,
                len(started),
            )
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
        return self._spawn([t], t.worker_id, self._follow(job, t))

    def abandon(self, job: Job, t: Track, reason: str) -> bool:
        """A running track whose worker is gone from the registry goes back to the queue (as an attempt
        of its own, so nothing else acts on it meanwhile). False when an attempt already holds it."""
        return self._spawn([t], t.worker_id, self._conclude(job, t, self.retry(job, t, reason, count=False)))

    async def _follow(self, job: Job, t: Track) -> None:
        w = self.pool.by_id(t.worker_id)
        if w is None or t.task_id is None:
            await self._conclude(job, t, self.retry(job, t, "its worker is no longer configured", count=False))
            return
        key, task_id = t.key, t.task_id
        if (fence := self.fence_of(w)) is None:  # not leased here (any more): the holder takes it over
            log.info("track %s/%d: not followed, worker %d is not leased here", *key, w.worker_id)
            return
        a = self.running[key]  # this task's own record (``_spawn``)
        a.fence, a.deadline = fence, time.monotonic() + self.time_allowed(job)
        w.assign(key, task_id)

        async def outcome() -> list[Outcome]:
            while True:
                try:
                    done = await w.client.task(task_id, self.lease_header(a.fence))
                except WorkerUnreachable as exc:
                    if not w.online or isinstance(exc, WorkerFault):  # a bad answer is not waited out
                        raise
                    done = None
                if done is not None:
                    log.info("track %s/%d: followed task %s to its end (%s)", *key, task_id, done.kind.value)
                    return [done]
                await asyncio.sleep(self.s.health_interval)

        await self._run(job, [t], w, outcome)

    def _spawn(
        self,
        tracks: list[Track],
        worker_id: int,
        coro: Coroutine[Any, Any, None],
        fence: Fence | None = None,
        deadline: float = math.inf,
    ) -> bool:
        """One asyncio task runs one attempt of ``tracks`` (several: the takes of one batch), on the
        store's background lane (a route that started it does not lend it its connections); each track
        gets its record in ``running`` until the task ends. Refused (False) while an attempt already
        holds one of them."""
        held = [t.key for t in tracks if t.key in self.running and not self.running[t.key].task.done()]
        if held:
            coro.close()
            log.info("track %s/%d: an attempt already holds it", *held[0])
            return False
        name = f"track-{tracks[0].job_id}-{'+'.join(str(t.index) for t in tracks)}"
        task = asyncio.create_task(coro, name=name, context=background_context())
        for t in tracks:
            self.running[t.key] = Attempt(worker_id, t.task_id, task, fence, deadline)
            task.add_done_callback(functools.partial(self._task_done, t.key))
        return True

    def _task_done(self, key: Key, task: asyncio.Task[None]) -> None:
        a = self.running.get(key)
        if a is not None and a.task is task:
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
        keys = [t.key for t in tracks]
        task_ids = [t.task_id for t in tracks]
        try:
            try:
                outcomes = await obtain()
            except asyncio.CancelledError:
                reason = next((r for k in keys if (r := self._stop_reason(k)) is not None), None)
                if reason is None:  # shutdown: the tracks stay running in the store and are followed again
                    raise
                asyncio.current_task().uncancel()  # type: ignore[union-attr]
                if reason in SILENT:  # the worker's lease holder takes these tasks over: leave them be
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
            w.copy_started()
            self.kick()
            try:
                for t, task_id, outcome in zip(tracks, task_ids, outcomes, strict=True):
                    await self._conclude(job, t, self._apply_or_retry(job, t, w, task_id, outcome))
            finally:
                w.copy_ended()
        except RetryTrack as exc:
            for t in tracks:
                await self._conclude(job, t, self._retry_after(job, t, w, exc))
        except Exception as exc:
            log.exception("track %s/%d: internal error", *keys[0])
            for t in tracks:
                await self._conclude(
                    job, t, self.retry(job, t, f"internal error ({type(exc).__name__})", fence=self._fence(t.key))
                )
        finally:
            for task_id in task_ids:
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
        fields = {
            "worker_phase": take.phase,
            "phase_progress": int(take.progress),
            "phase_detail": take.progress_detail,
            "phase_rate": take.tokens_per_sec,
            "preview_sec": take.preview_sec or 0.0,
        }
        status = status_of_phase(take.phase)
        a = self.running.get(t.key)
        if status is not t.status:
            await self.book.change(t, status, fence=self._fence(t.key), **fields)
            if a is not None:
                a.progress_saved_at = time.monotonic()
        elif self.book.show_progress(t, fields):
            await self._save_progress(t, a)
        else:
            return
        await self.book.progress_event(t)  # the job's webhook, if it asked for progress

    async def _save_progress(self, t: Track, a: Attempt | None) -> None:
        """Other dispatchers show a track's progress from the store: write it, at most once a second."""
        if not self.store.shared:
            return
        now = time.monotonic()
        if a is None or now - a.progress_saved_at >= PROGRESS_WRITE_SEC:
            if a is not None:
                a.progress_saved_at = now
            await self.store.save_progress(t, self._fence(t.key))

    async def _apply_or_retry(self, job: Job, t: Track, w: WorkerHandle, task_id: str | None, outcome: Outcome) -> None:
        try:
            await self._apply(job, t, w, task_id, outcome)
        except RetryTrack as exc:
            await self._retry_after(job, t, w, exc)

    async def _apply(self, job: Job, t: Track, w: WorkerHandle, task_id: str | None, outcome: Outcome) -> None:
        """What the worker's answer means for the track (``retries.next_state``), written; a failure
        while its files are copied raises ``RetryTrack`` for another attempt."""
        if t.task_id != task_id or t.status.terminal:
            log.info("track %s/%d: ignoring outcome of superseded task %s", job.job_id, t.index, task_id)
            return
        fence = self._fence(t.key)
        if fence is not None and (fence.epoch != w.lease_epoch or time.monotonic() >= w.lease_valid_until):
            # Lost, or not renewed in time (a pause?): not even the files. The repair asks the worker
            # again once the membership has read the lease (still ours: collected then).
            raise LeaseLost(t.key, fence)
        finished = outcome.kind is OutcomeKind.done and outcome.result is not None
        if not finished and outcome.kind in (OutcomeKind.done, OutcomeKind.error):  # the worker's breaker counts it
            if w.track_failed(outcome.environment, self.s.bench_after_failures, self.s.bench_sec, outcome.error):
                self.kick()
        # A job cancelled at another dispatcher a moment ago: the store knows (a finished take needs not ask).
        cancelled = job.cancelled if finished else await self._job_cancelled(job)
        step = retries.next_state(outcome, self._tries(t), cancelled, w.worker_id)
        if step.next is Next.collect and outcome.result is not None:
            await self._collect(job, t, w, task_id, outcome.result, fence)
            return
        if step.retried:
            t.avoid_worker = w.worker_id  # not back there while another worker can take it (``placement.pick``)
        await self._end(job, t, step, fence)
        if finished:
            await self._remove_worker_files(w, task_id)  # cancelled as it finished: its files are not wanted

    async def _collect(
        self, job: Job, t: Track, w: WorkerHandle, task_id: str | None, res: WorkerGenerateResult, fence: Fence | None
    ) -> None:
        """A finished take: its files copied and checked into the results folder, then the track done."""
        s, a = self.s, self.running.get(t.key)
        if a is not None:
            a.collecting = True  # held while the results folder cannot be written: nobody is charged
        try:
            await self.artifacts.collect(
                w.client,
                res,
                job.job_id,
                t.index,
                int(s.max_result_mb * 2**20),
                s.download_timeout_sec,
                s.download_floor_kb_per_sec * 1000,
            )
        except WorkerFault as exc:
            raise self._charge(w, f"the files of task {task_id}: {exc}") from None
        except asyncio.CancelledError:  # stopped while copying or held: the user cancelled
            if (reason := self._stop_reason(t.key)) is None:  # shutdown: followed again at the next start
                raise
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            raise RetryTrack(reason) from None
        finally:
            if a is not None:
                a.collecting = False
        now = time.time()
        meta = result_metadata(res, w.worker_id)
        meta["file_bytes"] = self.artifacts.sizes(job.job_id, t.index)
        await self.book.change(
            t,
            TrackStatus.done,
            fence=fence,
            finished_at=now,
            duration_sec=res.duration_sec,
            metadata=meta,
            seed=result_seed(res, t.seed),
            owner=None,
        )
        models, wall = res.metadata.get("models"), now - (t.started_at or now)
        self.speed.record(str(models.get("backbone", "")) if isinstance(models, dict) else "", t.duration_sec, wall)
        self.metrics.track_done(res.metadata, now - job.created_at, wall, t.duration_sec)
        w.track_succeeded()
        await self._remove_worker_files(w, task_id)
        log.info("track %s/%d: done (%.1fs audio, %.1fs)", job.job_id, t.index, t.duration_sec, wall)
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

    # ---- 3. the stop ----------------------------------------------------------------------------
    def time_allowed(self, job: Job) -> float:
        """Seconds an attempt of ``job``'s tracks may take."""
        return self.s.deadline_base_sec + self.s.deadline_factor * job.request.duration * 60

    def stop(self, key: Key, reason: str) -> None:
        """Ask a running attempt to stop and retry; later requests for the same attempt are no-ops."""
        a = self.running.get(key)
        if a is None or a.task.done() or a.stop_reason is not None:
            return
        a.stop_reason = reason
        log.warning("track %s/%d: %s", *key, reason)
        a.task.cancel(reason)

    def watch(self) -> None:
        """The watchdog's part: no progress for stall_timeout, or past the deadline: the attempt stops
        (and its track goes to another worker)."""
        now = time.monotonic()
        for w in self.pool.workers:
            stalled = bool(w.assigned) and now - w.last_progress_at > self.s.stall_timeout_sec
            for key in list(w.assigned.values()):
                a = self.running.get(key)
                if stalled:
                    w.mark_stalled()
                    self.stop(key, f"worker {w.worker_id} made no progress for {now - w.last_progress_at:.0f}s")
                elif a is not None and now > a.deadline and (job := self.book.jobs.get(key[0])) is not None:
                    self.stop(key, f"past its deadline of {self.time_allowed(job):.0f}s")

    async def cancel_running(self, tracks: list[Track]) -> None:
        """The user cancelled: each worker answers its running request with "cancelled" at its next
        check; a track whose worker does not know the task (or cannot stop one), or whose files are
        being copied (or wait for the results folder), stops here."""
        for t in tracks:
            if (a := self.running.get(t.key)) is not None and a.collecting:
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

    def _stop_reason(self, key: Key) -> str | None:
        a = self.running.get(key)
        return a.stop_reason if a is not None else None

    async def _cancel_on_worker(self, w: WorkerHandle, task_id: str | None) -> None:
        """Tell the worker to stop; shielded, so a shutdown arriving meanwhile does not cut it short."""
        if task_id is None:
            return
        try:
            await asyncio.shield(w.client.cancel(task_id, timeout=2))
        except WorkerUnreachable:
            pass

    async def _retry_after(self, job: Job, t: Track, w: WorkerHandle, exc: RetryTrack) -> None:
        """A failure on ``w`` ended the attempt: the track's next state, not back on ``w`` while another can take it."""
        if t.status.terminal:
            return
        t.avoid_worker = w.worker_id  # ``placement.pick``
        step = retries.next_state(exc, self._tries(t), await self._job_cancelled(job), w.worker_id)
        await self._end(job, t, step, self._fence(t.key))

    async def retry(self, job: Job, t: Track, reason: str, count: bool = True, fence: Fence | None = None) -> None:
        """The track runs again (queued), unless its job was cancelled or its attempts ran out."""
        if t.status.terminal:
            return
        step = retries.next_state(
            RetryTrack(reason, count), self._tries(t), await self._job_cancelled(job), t.worker_id
        )
        await self._end(job, t, step, fence)

    async def _end(self, job: Job, t: Track, step: NextState, fence: Fence | None) -> None:
        """Write the track's next state (cancelled, error or queued), store first; then its job may be finished."""
        if step.retried:
            self.metrics.retries.labels(str(t.worker_id)).inc()
        t.env_failures = step.env_failures
        now = time.time()
        if step.next is Next.cancelled:
            await self.book.change(t, TrackStatus.cancelled, fence, attempts=step.attempts, finished_at=now, owner=None)
        elif step.next is Next.error:
            await self.book.change(
                t, TrackStatus.error, fence, attempts=step.attempts, error=step.reason, finished_at=now, owner=None
            )
            log.warning("track %s/%d: error: %s", job.job_id, t.index, step.reason)
        else:
            log.warning("track %s/%d: retrying (%s)", job.job_id, t.index, step.reason)
            await self.book.change(
                t, TrackStatus.queued, fence, attempts=step.attempts, worker_id=-1, owner=None, **IDLE
            )
            self.book.enqueue(job, t)
            self.book.reorder()
        await self.book.finish_if_done(job)

    def _tries(self, t: Track) -> Tries:
        return Tries(t.attempts, t.env_failures, self.s.max_attempts, len(self.pool.workers))

    async def _job_cancelled(self, job: Job) -> bool:
        """Whether the job was cancelled, here or (the store says) at another dispatcher."""
        job.cancelled = job.cancelled or await self.store.is_cancelled(job.job_id)
        return job.cancelled

    # ---- 4. the fence ---------------------------------------------------------------------------
    async def _conclude(self, job: Job, t: Track, step: Awaitable[None]) -> None:
        """Run one step that writes a track's outcome; no error escapes it. A lost lease or a track
        changed elsewhere ends this dispatcher's part; a store failure leaves the track running here,
        for the repair to ask its worker again; anything else is a retry of the track."""
        try:
            await step
        except LeaseLost as exc:
            log.warning(
                "track %s/%d: %s is gone; this dispatcher stops acting for it (task %s)", *t.key, exc.fence, t.task_id
            )
        except StaleTrack:
            log.warning("track %s/%d: another dispatcher changed it first; leaving it to them", *t.key)
        except StoreError as exc:
            log.warning(
                "track %s/%d: its outcome could not be stored (%s); the repair asks worker %d again",
                *t.key,
                exc,
                t.worker_id,
            )
        except Exception as exc:
            log.exception("track %s/%d: internal error", *t.key)
            try:
                await self.retry(job, t, f"internal error ({type(exc).__name__})", fence=self._fence(t.key))
            except Exception as again:  # the store: the repair comes back to it
                log.warning("track %s/%d: its retry could not be stored (%s)", *t.key, again)

    def _fence(self, key: Key) -> Fence | None:
        a = self.running.get(key)
        return a.fence if a is not None else None

    def fence_of(self, w: WorkerHandle) -> Fence | None:
        """The lease this dispatcher holds on ``w`` now (None: none)."""
        return Fence(self.me, w.worker_id, w.lease_epoch) if w.leased and w.lease_epoch else None

    def lease_header(self, fence: Fence | None) -> str | None:
        """What the worker is told of the lease a call is made under (``worker/fence.py``)."""
        return f"{self.store.ident} {fence.epoch}" if fence is not None and self.store.ident else None

    def fenced_on(self, worker_id: int) -> bool:
        """Whether an attempt of this dispatcher still writes under its lease on ``worker_id`` (the
        worker may be free while its answer is applied): that lease is not given back yet."""
        return any(a.fence is not None and a.fence.worker_id == worker_id for a in self.running.values())

    def refence(self, w: WorkerHandle, old: int, new: int) -> None:
        """This dispatcher re-took ``w``'s lease and nobody held it between (epoch ``old`` + 1 = ``new``):
        the attempts there go on under the new epoch."""
        for a in self.running.values():
            if a.fence is not None and a.fence.worker_id == w.worker_id and a.fence.epoch == old:
                a.fence = dataclasses.replace(a.fence, epoch=new)
