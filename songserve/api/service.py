"""The job service: submit, cancel, dispatch, collect, retry, reconcile.

One instance per dispatcher process, driven from the event loop. Active (non-terminal) jobs live in
memory and in the store; finished ones only in the store and the artifact folder.

A track's lifetime:
    submit → queued → (dispatch loop picks it and an available worker) → running on the worker
      → ok: files copied to the results folder → done
      → the model failed with a clear error → error (not retried)
      → worker died / connection lost / worker lost the task / stalled / past its deadline
            → queued again while attempts remain, else error
      → user cancelled → cancelled (the worker confirms and is free for the next track)
Only the outcome of a track's current task id is applied, so a retried track finishes once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import time
from collections.abc import Coroutine
from typing import Any

import httpx

from songserve.api import scheduler
from songserve.api.artifacts import JOB_ID, ArtifactStore
from songserve.api.estimates import SpeedHistory
from songserve.api.pool import WorkerHandle, WorkerPool, WorkerState
from songserve.api.requests import NormalizedRequest, RequestLimits, normalize
from songserve.api.states import TERMINAL_JOB, TrackStatus, check_transition, job_status
from songserve.api.store import Job, JobStore, Track
from songserve.api.views import job_view, track_from_phase
from songserve.errors import NotFoundError, SongserveError, UnavailableError
from songserve.schemas import GenerateAccepted, GenerateRequest, JobView
from songserve.settings import DispatcherSettings

log = logging.getLogger(__name__)
Key = tuple[str, int]


class QueueFull(SongserveError):
    http_status = 429

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.headers = {"Retry-After": str(retry_after)}


class _Retry(Exception):
    """The track should run again (worker lost, stalled, deadline): reason for the log and error."""


class JobService:
    def __init__(
        self, s: DispatcherSettings, store: JobStore, artifacts: ArtifactStore, client: httpx.AsyncClient
    ) -> None:
        self.s = s
        self.store = store
        self.artifacts = artifacts
        self.client = client
        self.pool = WorkerPool(s.worker_list(), client, s.health_interval, s.offline_after_failures, self._on_worker)
        self.jobs: dict[str, Job] = {}  # active jobs only
        self.queue: dict[Key, scheduler.QueueEntry] = {}
        self.running: dict[Key, asyncio.Task] = {}
        self.accepting = True
        self.started_at = time.time()
        self.version = 0  # bumped on every visible change; SSE waits on it
        self._changed = asyncio.Event()
        self._kick = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.speed = SpeedHistory()
        self._positions: dict[Key, int] = {}
        self._unknown_fields_logged: set[str] = set()

    # ---- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
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
            self._maybe_finish(job)
        self._reorder()
        log.info(
            "restored %d active jobs (%d tracks queued, %d to reconcile)",
            len(self.jobs),
            len(self.queue),
            len(reattach),
        )
        for job, t in reattach:
            self._start_task((job.job_id, t.index), self._reattach(job, t))
        self.pool.start()
        self._tasks += [
            asyncio.create_task(self._dispatch_loop(), name="dispatch"),
            asyncio.create_task(self._watchdog_loop(), name="watchdog"),
            asyncio.create_task(self._retention_loop(), name="retention"),
        ]
        self._kick.set()

    async def drain(self, timeout: float) -> None:
        """Stop accepting; let running tracks finish up to ``timeout``; the queue stays persisted."""
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

    def _start_task(self, key: Key, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro, name=f"track-{key[0]}-{key[1]}")
        self.running[key] = task
        task.add_done_callback(functools.partial(self._task_done, key))

    def _task_done(self, key: Key, task: asyncio.Task) -> None:
        if self.running.get(key) is task:
            del self.running[key]
        if not task.cancelled() and task.exception() is not None:
            log.error("track %s/%d: unexpected failure", *key, exc_info=task.exception())
        self._kick.set()

    def _touch(self) -> None:
        self.version += 1
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_change(self, since: int, timeout: float) -> int:
        if self.version == since:
            try:
                await asyncio.wait_for(self._changed.wait(), timeout)
            except TimeoutError:
                pass
        return self.version

    # ---- submit / cancel / view ---------------------------------------------------------------
    def _validate(self, req: GenerateRequest) -> NormalizedRequest:
        if req.model_extra:
            new = set(req.model_extra) - self._unknown_fields_logged
            if new:
                log.info("ignoring unknown request fields: %s", ", ".join(sorted(new)))
                self._unknown_fields_logged |= new
        s = self.s
        limits = RequestLimits(
            s.min_duration,
            s.max_duration,
            s.max_tracks,
            s.max_lyrics_chars,
            tuple(self.models("backbone")),
            tuple(self.models("superres")),
        )
        return normalize(req, limits, strict=s.strict_requests, cleaning=s.lyrics_cleaning)

    def models(self, kind: str) -> list[str]:
        names: list[str] = []
        for w in self.pool.workers:
            for n in w.health.get(f"{kind}_models", []) or []:
                if n not in names:
                    names.append(n)
        return names

    def submit(self, req: GenerateRequest, idempotency_key: str | None = None) -> GenerateAccepted:
        if not self.accepting:
            raise UnavailableError("The dispatcher is shutting down and accepts no new jobs.")
        if idempotency_key:
            existing = self.store.job_by_key(idempotency_key)
            if existing:
                view = self.view(existing)
                return GenerateAccepted(
                    status="queued" if view.queue_position else "accepted",
                    job_id=existing,
                    num_tracks=len(view.tracks),
                    queue_position=view.queue_position,
                )
        norm = self._validate(req)
        req, lyrics = norm.request, norm.cleaned_lyrics
        if len(self.queue) + req.num_tracks > self.s.max_queue:
            retry = max(1, int(self.speed.queue_wait(len(self.queue), self.pool.online_count())))
            raise QueueFull(f"The queue is full ({len(self.queue)} tracks waiting); try again later.", retry)
        job_id = secrets.token_hex(8)
        base_seed = req.seed if req.seed is not None else secrets.randbelow(2**31 - 64)
        job = Job(
            job_id=job_id,
            seq=self.store.next_seq(),
            created_at=time.time(),
            request=req.model_dump(),
            cleaned_lyrics=lyrics,
            priority=req.priority,
            idempotency_key=idempotency_key or None,
            tracks=[Track(job_id, i, base_seed + i) for i in range(req.num_tracks)],
        )
        self.store.insert_job(job)
        self.jobs[job_id] = job
        for t in job.tracks:
            self._enqueue(job, t)
        log.info("job %s: %d tracks, %.2f min, priority %d", job_id, req.num_tracks, req.duration, req.priority)
        if norm.adjusted:
            log.info("job %s: read as the reference reads it: %s", job_id, norm.adjusted)
        idle = len(self.pool.available())
        self._dispatch_now()
        position = self._job_position(job)
        accepted = idle >= req.num_tracks or position == 0
        return GenerateAccepted(
            status="accepted" if accepted else "queued",
            job_id=job_id,
            num_tracks=req.num_tracks,
            queue_position=position,
            adjusted=norm.adjusted,
        )

    def _load(self, job_id: str) -> Job:
        job = self.jobs.get(job_id) or (self.store.load_job(job_id) if JOB_ID.match(job_id) else None)
        if job is None:
            raise NotFoundError(f"Job {job_id} not found.")
        return job

    def view(self, job_id: str) -> JobView:
        job = self._load(job_id)
        eta = self.speed.job_eta(job, self._positions, self.pool.online_count()) if job_id in self.jobs else None
        return job_view(job, self._positions, eta)

    async def cancel(self, job_id: str) -> JobView:
        job = self._load(job_id)
        if job_id not in self.jobs or job_status((t.status for t in job.tracks), job.cancelled) in TERMINAL_JOB:
            return self.view(job_id)  # finished: a no-op
        job.cancelled = True
        for t in job.tracks:
            if t.status is TrackStatus.queued:
                self.queue.pop((job_id, t.index), None)
                self._set(t, TrackStatus.cancelled, finished_at=time.time())
        self.store.save_job(job, terminal=False)
        running = [t for t in job.tracks if t.status.running]
        log.info("job %s: cancel (%d running tracks)", job_id, len(running))
        await asyncio.gather(*(self._cancel_on_worker(t) for t in running))
        self._reorder()
        self._maybe_finish(job)
        return self.view(job_id)

    async def _cancel_on_worker(self, t: Track) -> None:
        w = self.pool.by_id(t.worker_id)
        try:
            if w is None or t.task_id is None:
                raise httpx.ConnectError("no worker")
            r = await self.client.post(f"{w.url}/cancel/{t.task_id}", timeout=5)
            if r.status_code == 404:  # the worker no longer knows it: nothing runs there
                raise httpx.ConnectError("unknown task")
        except httpx.HTTPError:
            task = self.running.get((t.job_id, t.index))
            if task:
                task.cancel()
            self._set(t, TrackStatus.cancelled, finished_at=time.time())

    # ---- dispatch -----------------------------------------------------------------------------
    def _enqueue(self, job: Job, t: Track) -> None:
        """Queue a track; callers refresh the order once (``_reorder`` or a dispatch pass)."""
        self.queue[(job.job_id, t.index)] = scheduler.QueueEntry(job.job_id, t.index, job.priority, job.seq)

    def _started_counts(self) -> dict[str, int]:
        return {jid: sum(1 for t in j.tracks if t.status is not TrackStatus.queued) for jid, j in self.jobs.items()}

    def _reorder(self) -> list[scheduler.QueueEntry]:
        ordered = scheduler.order(self.queue.values(), self._started_counts())
        self._positions = {(e.job_id, e.index): i + 1 for i, e in enumerate(ordered)}
        self._touch()
        return ordered

    def _job_position(self, job: Job) -> int:
        pos = [self._positions[(job.job_id, t.index)] for t in job.tracks if (job.job_id, t.index) in self._positions]
        return min(pos) if pos else 0

    def _dispatch_now(self) -> None:
        ordered = scheduler.order(self.queue.values(), self._started_counts())
        for worker, entry in zip(self.pool.available(), ordered, strict=False):
            job = self.jobs[entry.job_id]
            t = job.tracks[entry.index]
            del self.queue[(entry.job_id, entry.index)]
            self._begin(job, t, worker)
        self._reorder()

    def _begin(self, job: Job, t: Track, w: WorkerHandle) -> None:
        now = time.time()
        t.attempts += 1
        t.task_id = f"{job.job_id}-{t.index}-{t.attempts}"
        t.worker_id, t.worker_phase, t.phase_detail, t.error = w.worker_id, "backbone", "", None
        self._set(t, TrackStatus.generating, progress=1, started_at=now)
        if job.started_at is None:
            job.started_at = now
            self.store.save_job(job, terminal=False)
        w.assign((job.job_id, t.index), t.task_id)
        log.info(
            "track %s/%d: attempt %d on worker %d (task %s)", job.job_id, t.index, t.attempts, w.worker_id, t.task_id
        )
        self._start_task((job.job_id, t.index), self._run(job, t, w))

    async def _dispatch_loop(self) -> None:
        while True:
            await self._kick.wait()
            self._kick.clear()
            if self.accepting:
                self._dispatch_now()

    def _on_worker(self, w: WorkerHandle, before: WorkerState) -> None:
        """Health poll result: refresh the running track's progress; kick the dispatcher."""
        if w.assigned and w.assigned[0] in self.jobs:
            job = self.jobs[w.assigned[0]]
            t = job.tracks[w.assigned[1]]
            h = w.health
            if w.online and h.get("task_id") == t.task_id and t.status.running and h.get("phase") not in (None, "idle"):
                status, progress = track_from_phase(h["phase"], int(h.get("progress", 0)))
                t.worker_phase, t.phase_detail = h["phase"], h.get("progress_detail", "")
                if status is not t.status:
                    self._set(t, status, progress=progress)
                elif progress != t.progress:
                    t.progress = progress
                    self._touch()
            lost = None
            if not w.online and before is not WorkerState.offline:
                lost = f"worker {w.worker_id} went offline"
            elif w.state is WorkerState.stalled and before is not WorkerState.stalled:
                lost = f"worker {w.worker_id} reported its model thread stalled"
            task = self.running.get(w.assigned) if lost else None
            if task:
                log.warning("track %s/%d: %s", w.assigned[0], w.assigned[1], lost)
                task.cancel(msg=lost)
        if w.available:
            self._kick.set()

    async def _watchdog_loop(self) -> None:
        """Stalled workers (no progress for stall_timeout) lose their track to another worker."""
        while True:
            await asyncio.sleep(min(1.0, self.s.health_interval))
            now = time.monotonic()
            for w in self.pool.workers:
                if w.assigned and now - w.last_progress_at > self.s.stall_timeout_sec:
                    task = self.running.get(w.assigned)
                    if task and not task.done():
                        log.warning(
                            "worker %d: no progress for %.0fs on task %s: stalled",
                            w.worker_id,
                            now - w.last_progress_at,
                            w.task_id,
                        )
                        w.health = {**w.health, "status": "stalled"}
                        task.cancel(msg="stalled")

    # ---- one track on one worker ----------------------------------------------------------------
    def _payload(self, job: Job, t: Track) -> dict:
        r = job.request
        natural = r.get("prompt_mode") == "natural"
        return {
            "genre": "",
            "language": "",
            "tags": "" if natural else r.get("tags", ""),
            "description": r.get("prompt", "") if natural else "",
            "duration": r["duration"],
            "lyrics": job.cleaned_lyrics,
            "backbone_name": r.get("backbone") or "",
            "superres_name": r.get("superres") or "",
            "top_k_bb": r["top_k_bb"],
            "top_k_sr": r["top_k_sr"],
            "temperature": r["temperature"],
            "superres_text_mode": "default",
            "raw_user_input": r.get("prompt") if natural else r.get("tags", ""),
            "raw_mode": r["mode"],
            "raw_prompt_mode": r["prompt_mode"],
            "seed_override": t.seed,
            "task_id": t.task_id,
            "job_id": job.job_id,
            "track_index": t.index,
        }

    def _deadline(self, job: Job) -> float:
        return self.s.deadline_base_sec + self.s.deadline_factor * job.request["duration"] * 60

    async def _run(self, job: Job, t: Track, w: WorkerHandle) -> None:
        task_id = t.task_id
        try:
            try:
                async with asyncio.timeout(self._deadline(job)):
                    r = await self.client.post(
                        f"{w.url}/generate", json=self._payload(job, t), timeout=httpx.Timeout(10, read=None)
                    )
                body = r.json()
            except TimeoutError:
                await self._cancel_quietly(w, task_id)
                raise _Retry(f"past its deadline of {self._deadline(job):.0f}s") from None
            except asyncio.CancelledError as exc:
                reason = _cancel_reason(exc)
                if reason is None:
                    raise
                await self._cancel_quietly(w, task_id)
                raise _Retry(reason) from None
            except (httpx.TransportError, ValueError) as exc:
                w.mark_unreachable()  # not used again until a health poll answers
                raise _Retry(f"worker {w.worker_id} connection lost ({type(exc).__name__})") from None
            # The worker answered: its model thread is free. Give it the next track while the
            # files are copied (pipelining; a failed copy retries the track like a lost worker).
            w.release(task_id)
            self._kick.set()
            await self._apply(job, t, w, task_id, r.status_code, body)
        except _Retry as exc:
            self._retry(job, t, str(exc))
        finally:
            w.release(task_id)
            self._kick.set()

    async def _reattach(self, job: Job, t: Track) -> None:
        """After a restart: find out what became of a track that was running on a worker."""
        w = self.pool.by_id(t.worker_id)
        task_id = t.task_id
        if w is None or task_id is None:
            self._retry(job, t, "its worker is no longer configured", count=False)
            return
        w.assign((job.job_id, t.index), task_id)
        try:
            while True:
                try:
                    r = await self.client.get(f"{w.url}/tasks/{task_id}", timeout=5)
                except httpx.TransportError:
                    if not w.online:
                        raise _Retry(f"worker {w.worker_id} unreachable after restart") from None
                    await asyncio.sleep(self.s.health_interval)
                    continue
                if r.status_code == 404:
                    raise _Retry(f"worker {w.worker_id} lost task {task_id}")
                view = r.json()
                if view["status"] == "running":
                    await asyncio.sleep(self.s.health_interval)
                    continue
                status_code = 200 if view["status"] in ("ok", "cancelled") else 500
                body = (
                    view["result"] if view["status"] == "ok" else {"status": view["status"], "error": view.get("error")}
                )
                log.info("track %s/%d: reconciled task %s (%s)", job.job_id, t.index, task_id, view["status"])
                await self._apply(job, t, w, task_id, status_code, body)
                return
        except asyncio.CancelledError as exc:
            reason = _cancel_reason(exc)
            if reason is None:
                raise
            self._retry(job, t, reason)
        except _Retry as exc:
            self._retry(job, t, str(exc))
        finally:
            w.release(task_id)
            self._kick.set()

    async def _apply(self, job: Job, t: Track, w: WorkerHandle, task_id: str | None, code: int, body: dict) -> None:
        if t.task_id != task_id or t.status.terminal:
            log.info("track %s/%d: ignoring outcome of superseded task %s", job.job_id, t.index, task_id)
            return
        status = body.get("status")
        if status == "ok":
            try:
                names = {"wav": body["wav_filename"], "mp3": body["mp3_filename"], "json": body["json_filename"]}
                await self.artifacts.fetch(self.client, w.url, names, job.job_id, t.index)
            except (httpx.HTTPError, KeyError) as exc:
                raise _Retry(f"could not copy the files from worker {w.worker_id} ({type(exc).__name__})") from None
            meta = body.get("metadata") or {}
            now = time.time()
            self._set(
                t,
                TrackStatus.done,
                progress=100,
                finished_at=now,
                duration_sec=float(body["duration_sec"]),
                metadata={k: meta.get(k) for k in ("models", "tokens", "timings", "sample_rate", "device")}
                | {"worker_id": w.worker_id},
            )
            self.speed.record(meta, t.duration_sec, now - (t.started_at or now))
            log.info(
                "track %s/%d: done (%.1fs audio, %.1fs)",
                job.job_id,
                t.index,
                t.duration_sec,
                now - (t.started_at or now),
            )
        elif status == "cancelled":
            if job.cancelled:
                self._set(t, TrackStatus.cancelled, finished_at=time.time())
            else:
                raise _Retry(f"worker {w.worker_id} stopped the task")
        elif status == "busy":
            t.attempts -= 1  # it never started; the worker was taken
            raise _Retry(f"worker {w.worker_id} was busy")
        elif code >= 500 and "error" in body:
            self._set(t, TrackStatus.error, error=str(body["error"]), finished_at=time.time())
            log.warning("track %s/%d: error: %s", job.job_id, t.index, body["error"])
        else:
            self._set(
                t,
                TrackStatus.error,
                error=str(body.get("error") or f"Worker answered HTTP {code}."),
                finished_at=time.time(),
            )
        self._maybe_finish(job)

    def _retry(self, job: Job, t: Track, reason: str, count: bool = True) -> None:
        if t.status.terminal:
            return
        if not count:
            t.attempts = max(0, t.attempts - 1)
        if job.cancelled:
            self._set(t, TrackStatus.cancelled, finished_at=time.time())
        elif t.attempts >= self.s.max_attempts:
            msg = f"Track failed after {t.attempts} attempts: {reason}."
            self._set(t, TrackStatus.error, error=msg, finished_at=time.time())
            log.warning("track %s/%d: %s", job.job_id, t.index, msg)
        else:
            log.warning("track %s/%d: retrying (%s)", job.job_id, t.index, reason)
            t.worker_id, t.worker_phase, t.phase_detail = -1, "idle", ""
            self._set(t, TrackStatus.queued, progress=0)
            self._enqueue(job, t)
            self._reorder()
        self._maybe_finish(job)

    async def _cancel_quietly(self, w: WorkerHandle, task_id: str | None) -> None:
        if task_id:
            try:
                await self.client.post(f"{w.url}/cancel/{task_id}", timeout=2)
            except httpx.HTTPError:
                pass

    # ---- state changes --------------------------------------------------------------------------
    def _set(self, t: Track, status: TrackStatus, **fields: object) -> None:
        check_transition(t.status, status)
        t.status = status
        for k, v in fields.items():
            setattr(t, k, v)
        self.store.save_track(t)
        self._touch()

    def _maybe_finish(self, job: Job) -> None:
        if all(t.status.terminal for t in job.tracks):
            job.finished_at = job.finished_at or time.time()
            self.store.save_job(job, terminal=True)
            self.jobs.pop(job.job_id, None)
            log.info("job %s: %s", job.job_id, job_status((t.status for t in job.tracks), job.cancelled).value)
            self._touch()

    # ---- retention ------------------------------------------------------------------------------
    def sweep(self) -> int:
        removed = 0
        for job_id in self.store.expired_jobs(time.time() - self.s.result_ttl_sec):
            self._remove(job_id)
            removed += 1
        cap = self.s.results_max_mb * 2**20
        total = self.artifacts.total_bytes()
        if total > cap:
            for job_id in self.store.finished_jobs_oldest_first():
                total -= self.artifacts.job_bytes(job_id)
                self._remove(job_id)
                removed += 1
                if total <= cap:
                    break
        if removed:
            log.info("retention: removed %d finished jobs", removed)
        return removed

    def _remove(self, job_id: str) -> None:
        self.artifacts.remove_job(job_id)
        self.store.delete_job(job_id)

    async def _retention_loop(self) -> None:
        while True:
            self.sweep()
            await asyncio.sleep(self.s.sweep_interval_sec)

    # ---- reporting ------------------------------------------------------------------------------
    def status(self) -> dict:
        workers = [w.public() for w in self.pool.workers]
        counts = self.store.counts()
        return {
            "total_gpus": len(workers),
            "idle_gpus": sum(w["status"] == "idle" for w in workers),
            "active_jobs": sum(1 for j in self.jobs.values() if any(t.status.running for t in j.tracks)),
            "queued_jobs": len({jid for jid, _ in self.queue}),
            "queued_tracks": len(self.queue),
            "running_tracks": len(self.running),
            "tracks_by_status": counts,
            "uptime_sec": round(time.time() - self.started_at, 1),
            "accepting": self.accepting,
            "workers": workers,
        }


def _cancel_reason(exc: asyncio.CancelledError) -> str | None:
    """Why we cancelled the current task ("worker offline", "stalled"), or None for a shutdown.

    Our own cancellations carry a message; the task is then uncancelled and handles it as a retry.
    """
    task = asyncio.current_task()
    msg = (exc.args[0] if exc.args else None) or getattr(task, "_cancel_message", None)
    if not msg or task is None:
        return None
    task.uncancel()
    return str(msg)
