"""The track state machine: every change of a track's state, and the outcome of an attempt.

A track's lifetime (the legal moves are in ``states.py``):

    queued ──dispatch──▶ generating → superres → decoding ──files copied──▶ done
      ▲                        │ the model failed with a clear sentence ──▶ error (not retried)
      └──── retry ◀────────────┤ worker lost / unreachable / lost the task / stalled / past deadline
                               │ / failed for an environment reason (while attempts remain, else error)
                               └ the user cancelled ─────────────────────▶ cancelled

Store first: a state change is written before it shows in memory (``_set`` writes the new state,
then applies it), so memory never claims what the store does not hold. Writes are compare-and-set
on the (status, owner) this dispatcher last saw: when another dispatcher changed the track first
(``StaleTrack``), nothing is applied and the job is read again from the store. Only the outcome of a
track's current task id is applied, so a retried track finishes once. ``Dispatcher`` (dispatch.py)
builds on this: it decides which worker runs which tracks and when an attempt stops.

With a shared store (PostgreSQL) the active jobs in memory are this dispatcher's view of the shared
queue: its own running tracks are the truth, the rest follow the store (``merge``, on every event).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from songserve.api import queue_order
from songserve.api.artifacts import ArtifactStore
from songserve.api.estimates import SpeedHistory
from songserve.api.metrics import DispatcherMetrics
from songserve.api.outcomes import Outcome, OutcomeKind, WorkerUnreachable
from songserve.api.pool import WorkerHandle, WorkerPool
from songserve.api.states import TrackStatus, check_transition, job_status
from songserve.api.store import STORED_TRACK_FIELDS, Job, JobStore, Key, StaleTrack, Track
from songserve.api.to_worker import result_files, result_metadata, result_seed
from songserve.settings import DispatcherSettings

log = logging.getLogger(__name__)
IDLE: dict[str, object] = {"worker_phase": "idle", "phase_progress": 0, "phase_detail": "", "phase_rate": None}


class RetryTrack(Exception):
    """The track should run again; ``count`` is False when the attempt never started, or when the
    worker failed it for an environment reason (``environment``: disk, memory, writes)."""

    def __init__(self, reason: str, count: bool = True, environment: bool = False) -> None:
        super().__init__(reason)
        self.count = count and not environment
        self.environment = environment


class ChangeFeed:
    """A version number bumped on every visible change; SSE streams wait on it."""

    def __init__(self) -> None:
        self.version = 0
        self._event = asyncio.Event()

    def touch(self) -> None:
        self.version += 1
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, since: int, timeout: float) -> int:
        if self.version == since:
            try:
                await asyncio.wait_for(self._event.wait(), timeout)
            except TimeoutError:
                pass
        return self.version


class TrackBook:
    """The active jobs, the queue, and every transition of their tracks."""

    pool: WorkerPool
    metrics: DispatcherMetrics

    def __init__(self, s: DispatcherSettings, store: JobStore, artifacts: ArtifactStore, me: str) -> None:
        self.s = s
        self.store = store
        self.me = me  # this dispatcher's id: the owner written on the tracks it runs
        self.artifacts = artifacts
        self.speed = SpeedHistory()
        self.changes = ChangeFeed()
        self.jobs: dict[str, Job] = {}  # active jobs only
        self.queue: dict[Key, queue_order.QueueEntry] = {}
        self.positions: dict[Key, int] = {}  # 1-based queue positions
        self.running: dict[Key, asyncio.Task[None]] = {}  # this dispatcher's attempts, by track
        self._kick = asyncio.Event()  # something changed that may let a track start
        self._write = asyncio.Lock()  # one track write at a time: each sees the state the last one left
        self._dirty: set[str] = set()  # jobs to read again from the store ("*": all)
        self._dirty_event = asyncio.Event()

    def _enqueue(self, job: Job, t: Track) -> None:
        """Queue a track; callers refresh the order once (``_reorder`` or a dispatch pass)."""
        self.queue[(job.job_id, t.index)] = queue_order.QueueEntry(job.job_id, t.index, job.priority, job.seq)
        t.queued_at = time.time()

    def _started_counts(self) -> dict[str, int]:
        return {jid: sum(t.status is not TrackStatus.queued for t in j.tracks) for jid, j in self.jobs.items()}

    def _reorder(self) -> None:
        ordered = queue_order.order(self.queue.values(), self._started_counts())
        self.positions = {(e.job_id, e.index): i + 1 for i, e in enumerate(ordered)}
        self.changes.touch()

    async def _apply(self, job: Job, t: Track, w: WorkerHandle, task_id: str | None, outcome: Outcome) -> None:
        if t.task_id != task_id or t.status.terminal:
            log.info("track %s/%d: ignoring outcome of superseded task %s", job.job_id, t.index, task_id)
            return
        if outcome.kind is OutcomeKind.done and outcome.result is not None:
            res = outcome.result
            try:
                await self.artifacts.fetch(w.client, result_files(res), job.job_id, t.index)
            except (WorkerUnreachable, OSError) as exc:
                raise RetryTrack(f"could not copy the files from worker {w.worker_id} ({exc})") from None
            now = time.time()
            meta = result_metadata(res, w.worker_id)
            meta["file_bytes"] = self.artifacts.sizes(job.job_id, t.index)
            await self._set(t, TrackStatus.done, finished_at=now, duration_sec=res.duration_sec, metadata=meta,
                            seed=result_seed(res, t.seed), owner=None)  # fmt: skip
            self._record_done(job, t, res.metadata, now)
            w.track_succeeded()
            await self._remove_worker_files(w, task_id)
            log.info(
                "track %s/%d: done (%.1fs audio, %.1fs)",
                job.job_id,
                t.index,
                t.duration_sec,
                now - (t.started_at or now),
            )
        elif outcome.kind is OutcomeKind.cancelled:
            # The job may have been cancelled at another dispatcher a moment ago: the store knows.
            job.cancelled = job.cancelled or await self.store.is_cancelled(job.job_id)
            if not job.cancelled:
                raise RetryTrack(f"worker {w.worker_id} stopped the task")
            await self._set(t, TrackStatus.cancelled, finished_at=time.time(), owner=None)
        elif outcome.kind is OutcomeKind.busy:
            raise RetryTrack(f"worker {w.worker_id} was busy", count=False)
        else:
            s = self.s
            if w.track_failed(outcome.environment, s.bench_after_failures, s.bench_sec, outcome.error):
                self._kick.set()
            if outcome.environment and t.env_failures + 1 < s.max_attempts * max(1, len(self.pool.workers)):
                raise RetryTrack(f"worker {w.worker_id}: {outcome.error}", environment=True)
            await self._set(t, TrackStatus.error, error=outcome.error, finished_at=time.time(), owner=None)
            log.warning("track %s/%d: error: %s", job.job_id, t.index, outcome.error)
        await self.finish_if_done(job)

    async def _remove_worker_files(self, w: WorkerHandle, task_id: str | None) -> None:
        """The files are ours now: the worker may delete its copies (its age sweep is the safety net)."""
        if task_id is None:
            return
        try:
            await w.client.remove_files(task_id)
        except WorkerUnreachable as exc:
            log.info("worker %d: files of %s not removed (%s)", w.worker_id, task_id, exc)

    def _record_done(self, job: Job, t: Track, meta: dict[str, object], now: float) -> None:
        m, wall = self.metrics, now - (t.started_at or now)
        models = meta.get("models")
        self.speed.record(str(models.get("backbone", "")) if isinstance(models, dict) else "", t.duration_sec, wall)
        timings = meta.get("timings")
        for stage, sec in timings.items() if isinstance(timings, dict) else ():
            if isinstance(sec, int | float):
                m.stage.labels(stage.removesuffix("_sec")).observe(sec)
        m.end_to_end.observe(now - job.created_at)
        m.track_wall.observe(wall)
        m.track_audio.inc(t.duration_sec)

    async def _retry(self, job: Job, t: Track, reason: str, count: bool = True) -> None:
        if t.status.terminal:
            return
        self.metrics.retries.labels(str(t.worker_id)).inc()
        attempts = t.attempts if count else max(0, t.attempts - 1)
        now = time.time()
        if job.cancelled or await self.store.is_cancelled(job.job_id):
            job.cancelled = True
            await self._set(t, TrackStatus.cancelled, attempts=attempts, finished_at=now, owner=None)
        elif attempts >= self.s.max_attempts:
            msg = f"Track failed after {attempts} attempts: {reason}."
            await self._set(t, TrackStatus.error, attempts=attempts, error=msg, finished_at=now, owner=None)
            log.warning("track %s/%d: %s", job.job_id, t.index, msg)
        else:
            log.warning("track %s/%d: retrying (%s)", job.job_id, t.index, reason)
            await self._set(t, TrackStatus.queued, attempts=attempts, worker_id=-1, owner=None, **IDLE)
            self._enqueue(job, t)
            self._reorder()
        await self.finish_if_done(job)

    async def _set(self, t: Track, status: TrackStatus, **fields: object) -> None:
        """Write the track's new state to the store, then keep it in memory.

        Compare-and-set on what this dispatcher last saw: when another dispatcher changed the track
        first, nothing changes here, the job is read again, and ``StaleTrack`` is raised.
        """
        async with self._write:
            check_transition(t.status, status)
            new = dataclasses.replace(t, status=status, **fields)  # type: ignore[arg-type]
            try:
                await self.store.save_track(new, (t.status, t.owner))
            except StaleTrack:
                log.info("track %s/%d: changed by another dispatcher; reading it again", *t.key)
                self.resync(t.job_id)
                raise
            for k in ("status", *fields):
                setattr(t, k, getattr(new, k))
        self.changes.touch()

    async def cancel_queued(self, job: Job) -> None:
        """The job's queued tracks leave the queue as cancelled; the others' positions move up."""
        for t in job.tracks:
            if t.status is TrackStatus.queued:
                try:
                    await self._set(t, TrackStatus.cancelled, finished_at=time.time())
                except StaleTrack:  # another dispatcher started it meanwhile: it stops on the job's cancel
                    continue
                self.queue.pop(t.key, None)
        self._reorder()

    async def finish_if_done(self, job: Job) -> None:
        """A job whose tracks all ended is finished in the store (whichever dispatcher ran them)."""
        if not all(t.status.terminal for t in job.tracks):
            return
        now = job.end_time() or time.time()  # the last track's end: what the job's view showed until now
        if not await self.store.finish_job(job.job_id, now):
            self.resync(job.job_id)  # memory is ahead of or behind the store: read it again
            return
        job.finished_at, job.terminal = job.finished_at or now, True
        for t in job.tracks:
            self.metrics.finished.labels(str(t.worker_id), t.status.value).inc()
        self.jobs.pop(job.job_id, None)
        log.info("job %s: %s", job.job_id, job_status((t.status for t in job.tracks), job.cancelled).value)
        self.changes.touch()

    # ---- following the shared store ------------------------------------------------------------
    def resync(self, job_id: str) -> None:
        """Read ``job_id`` (``*``: every active job) from the store again, soon (the sync loop does)."""
        self._dirty.add(job_id)
        self._dirty_event.set()

    async def sync_step(self) -> None:
        await self._dirty_event.wait()
        self._dirty_event.clear()
        dirty, self._dirty = self._dirty, set()
        if "*" in dirty:
            stored = {j.job_id: j for j in await self.store.active_jobs()}
            for job_id in set(self.jobs) | set(stored):
                self.merge(job_id, stored.get(job_id))
        else:
            for job_id in dirty:
                self.merge(job_id, await self.store.load_job(job_id))
        self._reorder()
        self._kick.set()

    def merge(self, job_id: str, stored: Job | None) -> None:
        """Take the store's state of a job into memory; this dispatcher's own attempts stay as they are."""
        mem = self.jobs.get(job_id)
        if stored is None or stored.terminal:
            if mem is not None and not any(t.key in self.running for t in mem.tracks):
                for t in mem.tracks:
                    self.queue.pop(t.key, None)
                del self.jobs[job_id]
                self.changes.touch()
            return
        if mem is None:
            self.jobs[job_id] = mem = stored
            for t in stored.tracks:
                if t.status is TrackStatus.queued:
                    self._enqueue(stored, t)
            self.changes.touch()
            return
        newly_cancelled = stored.cancelled and not mem.cancelled
        mem.cancelled, mem.started_at = stored.cancelled, stored.started_at
        for t, fresh in zip(mem.tracks, stored.tracks, strict=True):
            if t.key in self.running:
                self.queue.pop(t.key, None)  # ours and live: memory is the truth (a read from before our claim)
                continue
            for name in STORED_TRACK_FIELDS:
                setattr(t, name, getattr(fresh, name))
            if t.status is TrackStatus.queued and t.key not in self.queue:
                self._enqueue(mem, t)
            elif t.status is not TrackStatus.queued:
                self.queue.pop(t.key, None)
        if newly_cancelled:
            for t in mem.tracks:
                if t.key in self.running:
                    self.on_cancelled(t.key)
        self.changes.touch()

    def on_cancelled(self, key: Key) -> None:
        """The job of a track this dispatcher runs was cancelled elsewhere (dispatch.py stops it)."""
