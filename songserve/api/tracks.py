"""The track state machine: every change of a track's state, and the outcome of an attempt.

A track's lifetime (the legal moves are in ``states.py``):

    queued ──dispatch──▶ generating → superres → decoding ──files copied──▶ done
      ▲                        │ the model failed with a clear sentence ──▶ error (not retried)
      └──── retry ◀────────────┤ worker lost / unreachable / lost the task / stalled / past deadline
                               │ / failed for an environment reason (while attempts remain, else error)
                               └ the user cancelled ─────────────────────▶ cancelled

Store first: a state change is written before it shows in memory (``_set`` rolls back a failed
write), so memory never claims what the store does not hold. Only the outcome of a track's current
task id is applied, so a retried track finishes once. ``Dispatcher`` (dispatch.py) builds on this:
it decides which worker runs which tracks and when an attempt stops.
"""

from __future__ import annotations

import asyncio
import logging
import time

from songserve.api import queue_order
from songserve.api.artifacts import ArtifactStore
from songserve.api.estimates import SpeedHistory
from songserve.api.metrics import DispatcherMetrics
from songserve.api.pool import Key, WorkerHandle, WorkerPool
from songserve.api.states import TrackStatus, check_transition, job_status
from songserve.api.store import Job, JobStore, Track
from songserve.api.worker_client import Outcome, OutcomeKind, WorkerUnreachable
from songserve.settings import DispatcherSettings

log = logging.getLogger(__name__)
METADATA_KEYS = ("models", "tokens", "timings", "sample_rate", "device")


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

    def __init__(self, s: DispatcherSettings, store: JobStore, artifacts: ArtifactStore) -> None:
        self.s = s
        self.store = store
        self.artifacts = artifacts
        self.speed = SpeedHistory()
        self.changes = ChangeFeed()
        self.jobs: dict[str, Job] = {}  # active jobs only
        self.queue: dict[Key, queue_order.QueueEntry] = {}
        self.positions: dict[Key, int] = {}  # 1-based queue positions
        self._kick = asyncio.Event()  # something changed that may let a track start

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
            names = {"wav": res.wav_filename, "mp3": res.mp3_filename}
            if res.json_filename:
                names["json"] = res.json_filename
            try:
                await self.artifacts.fetch(w.client, names, job.job_id, t.index)
            except (WorkerUnreachable, OSError) as exc:
                raise RetryTrack(f"could not copy the files from worker {w.worker_id} ({exc})") from None
            now = time.time()
            meta = {k: res.metadata.get(k) for k in METADATA_KEYS} | {"worker_id": w.worker_id}
            meta["file_bytes"] = self.artifacts.sizes(job.job_id, t.index)
            # The seed the worker used (a worker reads seed_override 0 as its own seed, as the reference).
            seed = res.seed if res.seed is not None else t.seed
            self._set(t, TrackStatus.done, finished_at=now, duration_sec=res.duration_sec, metadata=meta, seed=seed)
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
            if not job.cancelled:
                raise RetryTrack(f"worker {w.worker_id} stopped the task")
            self._set(t, TrackStatus.cancelled, finished_at=time.time())
        elif outcome.kind is OutcomeKind.busy:
            raise RetryTrack(f"worker {w.worker_id} was busy", count=False)
        else:
            s = self.s
            if w.track_failed(outcome.environment, s.bench_after_failures, s.bench_sec, outcome.error):
                self._kick.set()
            if outcome.environment and t.env_failures + 1 < s.max_attempts * max(1, len(self.pool.workers)):
                raise RetryTrack(f"worker {w.worker_id}: {outcome.error}", environment=True)
            self._set(t, TrackStatus.error, error=outcome.error, finished_at=time.time())
            log.warning("track %s/%d: error: %s", job.job_id, t.index, outcome.error)
        self.finish_if_done(job)

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

    def _retry(self, job: Job, t: Track, reason: str, count: bool = True) -> None:
        if t.status.terminal:
            return
        self.metrics.retries.labels(str(t.worker_id)).inc()
        attempts = t.attempts if count else max(0, t.attempts - 1)
        now = time.time()
        if job.cancelled:
            self._set(t, TrackStatus.cancelled, attempts=attempts, finished_at=now)
        elif attempts >= self.s.max_attempts:
            msg = f"Track failed after {attempts} attempts: {reason}."
            self._set(t, TrackStatus.error, attempts=attempts, error=msg, finished_at=now)
            log.warning("track %s/%d: %s", job.job_id, t.index, msg)
        else:
            log.warning("track %s/%d: retrying (%s)", job.job_id, t.index, reason)
            self._set(t, TrackStatus.queued, attempts=attempts, worker_id=-1, worker_phase="idle", phase_progress=0)
            self._enqueue(job, t)
            self._reorder()
        self.finish_if_done(job)

    def _set(self, t: Track, status: TrackStatus, **fields: object) -> None:
        """Write the track's new state to the store, then keep it in memory (rolled back on failure)."""
        check_transition(t.status, status)
        old = {k: getattr(t, k) for k in ("status", *fields)}
        t.status = status
        for k, v in fields.items():
            setattr(t, k, v)
        try:
            self.store.save_track(t)
        except Exception:
            for k, v in old.items():
                setattr(t, k, v)
            raise
        self.changes.touch()

    def cancel_queued(self, job: Job) -> None:
        """The job's queued tracks leave the queue as cancelled; the others' positions move up."""
        for t in job.tracks:
            if t.status is TrackStatus.queued:
                self._set(t, TrackStatus.cancelled, finished_at=time.time())
                self.queue.pop((job.job_id, t.index), None)
        self._reorder()

    def finish_if_done(self, job: Job) -> None:
        if not all(t.status.terminal for t in job.tracks):
            return
        for t in job.tracks:
            self.metrics.finished.labels(str(t.worker_id), t.status.value).inc()
        job.finished_at = job.finished_at or time.time()
        self.store.save_job(job, terminal=True)
        self.jobs.pop(job.job_id, None)
        log.info("job %s: %s", job.job_id, job_status((t.status for t in job.tracks), job.cancelled).value)
        self.changes.touch()
