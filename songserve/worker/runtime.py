"""The worker's runtime: model lifecycle and the single model thread.

All model work (loading and generation) runs on one dedicated thread, so async routes keep
answering ``/health`` while a track generates. One task at a time; a second gets ``BusyError``.
Finished tasks are remembered (bounded) so a dispatcher that lost the connection can collect them.

States (``WorkerStatus``):  initializing → idle ⇄ busy;  any → error (loading failed / thread died).

A failed task carries an ``ErrorKind`` (``classify_failure``): a full disk, a write error or out of
memory is the worker's environment, not the track, so the dispatcher may try another worker; the
sentence names the disk when it is the disk. The worker reports its output disk in ``/health``
(``disk_report``) and removes its own output files: per task once collected (``remove_task_files``)
and by age as a safety net (``sweep_outputs``). Stalls are measured on the monotonic clock.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from songserve.errors import (
    BusyError,
    NotFoundError,
    RequestError,
    SongserveError,
    TaskCancelled,
    TaskError,
    UnavailableError,
)
from songserve.pipeline.context import TaskContext
from songserve.pipeline.types import Pipeline, TrackRequest, TrackResult
from songserve.schemas import (
    ErrorKind,
    TaskState,
    TaskView,
    WorkerGenerateRequest,
    WorkerGenerateResult,
    WorkerPhase,
    WorkerStatus,
)
from songserve.settings import WorkerSettings
from songserve.worker.device import Device
from songserve.worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)
MAX_REMEMBERED_TASKS = 256
OUTPUT_SUFFIXES = (".wav", ".mp3", ".json", ".tmp")  # what export writes; nothing else is ever removed
OUTPUT_NAME = re.compile(r"^\.?[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}$")


class ClassifiedTaskError(TaskError):
    """A task failure with its kind (environment, model or request), for the error body and ``TaskView``."""

    def __init__(self, message: str, kind: ErrorKind) -> None:
        super().__init__(message)
        self.kind = kind


def error_kind_of(exc: BaseException) -> ErrorKind | None:
    """The kind of a task failure raised by ``generate``; None for refusals that are not failures."""
    if isinstance(exc, ClassifiedTaskError):
        return exc.kind
    if isinstance(exc, RequestError):
        return ErrorKind.request
    if isinstance(exc, TaskError):
        return ErrorKind.model
    return None


def rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return 0.0


def to_track_request(body: WorkerGenerateRequest, seed: int, task_id: str) -> TrackRequest:
    instrumental = body.raw_mode == "instrumental" or body.language.lower() == "instrumental"
    return TrackRequest(
        lyrics=body.lyrics,
        duration=body.duration,
        genre=body.genre,
        language=body.language,
        tags=body.tags,
        description=body.description,
        instrumental=instrumental,
        backbone_name=body.backbone_name,
        superres_name=body.superres_name,
        top_k_bb=body.top_k_bb,
        top_k_sr=body.top_k_sr,
        temperature=body.temperature,
        superres_text_mode=body.superres_text_mode,
        seed=seed,
        task_id=task_id,
        job_id=body.job_id,
        track_index=body.track_index,
        extra={
            "raw_user_input": body.raw_user_input,
            "raw_mode": body.raw_mode,
            "raw_prompt_mode": body.raw_prompt_mode,
        },
    )


class WorkerRuntime:
    def __init__(self, settings: WorkerSettings, pipeline: Pipeline, device: Device) -> None:
        self.s = settings
        self.pipeline = pipeline
        self.device = device
        self.status = WorkerStatus.initializing
        self.phase = WorkerPhase.idle.value
        self.error: str | None = None
        self.started_at = time.time()
        self._started_mono = time.monotonic()
        self.tasks_done = 0
        self.accepting = True
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self._lock = threading.Lock()
        self._current: TaskContext | None = None  # the first take of the running batch
        self._batch: list[TaskContext] = []  # every take of the running batch
        self._last_ids: list[str] = []
        self._tasks: OrderedDict[str, TaskView] = OrderedDict()
        self.metrics = WorkerMetrics()
        self.metrics.watch(self.health)
        pipeline.phase_hook = self._set_phase
        self._models = pipeline.describe()

    def _set_phase(self, phase: str) -> None:
        self.phase = phase

    # -- lifecycle ------------------------------------------------------------------------------
    def _load(self) -> None:
        self.device.prepare_thread()
        t0 = time.perf_counter()
        self.pipeline.load()
        # Everything loaded so far lives as long as the process: keep it out of every later
        # garbage collection (a full collection over torch + megatron's objects takes ~0.2 s).
        gc.collect()
        gc.freeze()
        self.phase = WorkerPhase.idle.value
        log.info("models ready in %.1fs on %s (%s)", time.perf_counter() - t0, self.device.name, self.s.runtime_mode)

    async def start(self) -> None:
        """Load on the model thread; raises (and marks the worker ``error``) if loading fails."""
        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, self._load)
        except Exception as exc:
            self.status, self.error = WorkerStatus.error, str(exc)
            raise
        self.status = WorkerStatus.idle

    def shutdown(self) -> None:
        for ctx in list(self._batch):
            ctx.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)

    @property
    def model_thread_busy(self) -> bool:
        return self._current is not None

    async def drain(self, timeout: float) -> None:
        """SIGTERM: take no new task; let the running one finish for ``timeout``, else cancel it."""
        self.accepting = False
        ctx = self._current
        if ctx is None:
            return
        log.info("draining: waiting up to %.0fs for task %s", timeout, ctx.task_id)
        deadline = time.monotonic() + timeout
        while self._current is ctx and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._current is ctx:
            log.warning("task %s: cancelled by shutdown", ctx.task_id)
            for c in list(self._batch):
                c.cancel()
            deadline = time.monotonic() + 5
            while self._current is ctx and time.monotonic() < deadline:  # it answers "cancelled"
                await asyncio.sleep(0.05)

    # -- tasks ----------------------------------------------------------------------------------
    def _remember(self, view: TaskView) -> None:
        self._tasks[view.task_id] = view
        self._tasks.move_to_end(view.task_id)
        while len(self._tasks) > MAX_REMEMBERED_TASKS:
            self._tasks.popitem(last=False)

    def _claim(self, bodies: list[WorkerGenerateRequest]) -> list[TaskContext]:
        """Register a batch's tasks, or raise why the worker cannot take it now."""
        if not self.accepting:
            raise UnavailableError("The worker is shutting down and takes no new task.")
        for body in bodies:
            self.check_model_names(body)
        ids = [b.task_id or uuid.uuid4().hex[:12] for b in bodies]
        if len(set(ids)) != len(ids):
            raise RequestError("The takes of a batch need distinct task_id values.")
        with self._lock:
            if self.status is not WorkerStatus.idle:
                if self.status is WorkerStatus.busy and self._current is not None:
                    raise BusyError(f"The worker is already running task {self._current.task_id}.")
                raise BusyError(f"The worker is {self.status.value}, not ready for a task.")
            for task_id in ids:
                if task_id in self._tasks:
                    raise RequestError(f"Task {task_id} was already run on this worker.")
            ctxs = [TaskContext(task_id) for task_id in ids]
            self._batch, self._current, self.status = ctxs, ctxs[0], WorkerStatus.busy
            for task_id in ids:
                self._remember(TaskView(task_id=task_id, status=TaskState.running))
        return ctxs

    async def generate(self, body: WorkerGenerateRequest) -> WorkerGenerateResult:
        """One take: its result, or the exception that ended it (raised)."""
        out = (await self._generate([body]))[0]
        if isinstance(out, BaseException):
            raise out
        return out

    async def generate_batch(
        self, bodies: list[WorkerGenerateRequest]
    ) -> list[tuple[str, WorkerGenerateResult | SongserveError]]:
        """Several takes of one request as one batch; per take (task id, its result or its own error)."""
        results = await self._generate(bodies)
        return [(ids, r) for ids, r in zip(self._last_ids, results, strict=True)]

    async def _generate(self, bodies: list[WorkerGenerateRequest]) -> list[WorkerGenerateResult | SongserveError]:
        ctxs = self._claim(bodies)
        self._last_ids = [c.task_id for c in ctxs]
        reqs = []
        for body, ctx in zip(bodies, ctxs, strict=True):
            seed = body.seed_override or self.s.seed  # None or 0 = the worker's own seed, as the reference
            reqs.append(to_track_request(body, seed, ctx.task_id))
            log.info(
                "task %s: start (job %s track %d, %.2f min, seed %d, batch of %d)",
                ctx.task_id,
                body.job_id,
                body.track_index,
                body.duration,
                seed,
                len(bodies),
            )
        t0 = time.perf_counter()
        try:
            raw = await asyncio.get_running_loop().run_in_executor(self._executor, self._run, reqs, ctxs)
        except Exception as exc:  # the whole batch failed (a request error, or the model)
            raw = [exc] * len(ctxs)
        finally:
            with self._lock:
                self._current, self._batch = None, []
                self.phase = WorkerPhase.idle.value
                if self.status is WorkerStatus.busy:
                    self.status = WorkerStatus.idle
        out: list[WorkerGenerateResult | SongserveError] = []
        for ctx, got in zip(ctxs, raw, strict=True):
            out.append(self._settle(ctx.task_id, got, t0))
        return out

    def _settle(
        self, task_id: str, got: TrackResult | BaseException, t0: float
    ) -> WorkerGenerateResult | SongserveError:
        """Record one take's outcome; return its result or its error (never raises)."""
        if isinstance(got, TaskCancelled):
            log.info("task %s: cancelled after %.2fs", task_id, time.perf_counter() - t0)
            self._remember(
                TaskView(task_id=task_id, status=TaskState.cancelled, error=f"Task {task_id} was cancelled.")
            )
            self.metrics.tasks.labels("cancelled").inc()
            return got
        if isinstance(got, SongserveError):
            kind = error_kind_of(got)
            log.warning("task %s: %s error: %s", task_id, kind.value if kind else "task", got)
            self._remember(TaskView(task_id=task_id, status=TaskState.error, error=str(got), error_kind=kind))
            self.metrics.tasks.labels(f"error_{kind.value}" if kind else "refused").inc()
            return got
        if isinstance(got, BaseException):  # out of memory, encoder or disk errors: local to this task
            log.error("task %s: failed", task_id, exc_info=got)
            kind, message = classify_failure(got, self.s.output_dir, self.device.is_out_of_memory(got))
            self._remember(TaskView(task_id=task_id, status=TaskState.error, error=message, error_kind=kind))
            self.metrics.tasks.labels(f"error_{kind.value}").inc()
            return ClassifiedTaskError(message, kind)
        self.tasks_done += 1
        out = WorkerGenerateResult(
            task_id=task_id,
            mp3_filename=got.mp3_filename,
            wav_filename=got.wav_filename,
            json_filename=got.json_filename,
            duration_sec=got.duration_sec,
            backbone_tokens=got.backbone_tokens,
            gpu_id=self.s.gpu_id,
            seed=got.seed,
            metadata=got.metadata,
        )
        self._remember(TaskView(task_id=task_id, status=TaskState.done, result=out, progress=100))
        log.info("task %s: done in %.2fs (%.2fs audio)", task_id, time.perf_counter() - t0, got.duration_sec)
        self.metrics.task_done(time.perf_counter() - t0, got.duration_sec, got.metadata.get("timings") or {})
        return out

    def check_model_names(self, body: WorkerGenerateRequest) -> None:
        """Refuse an unknown model name before any work (not after the whole backbone stage)."""
        for what, name, known in (
            ("backbone", body.backbone_name, self._models["backbone_models"]),
            ("superres", body.superres_name, self._models["superres_models"]),
        ):
            if name and name not in known:
                raise RequestError(f"Unknown {what} model {name!r}; available: {', '.join(known)}.")

    def _run(self, reqs: list[TrackRequest], ctxs: list[TaskContext]) -> list[TrackResult | BaseException]:
        """On the model thread."""
        with self.device.inference():
            return self.pipeline.run_batch(reqs, ctxs)

    def _find(self, task_id: str) -> TaskContext | None:
        """The running take with ``task_id`` (one of the batch), else None."""
        running = [*self._batch, *([self._current] if self._current is not None else [])]
        return next((c for c in running if c.task_id == task_id), None)

    def cancel(self, task_id: str) -> TaskView:
        ctx = self._find(task_id)
        if ctx is not None:
            ctx.cancel()
            log.info("task %s: cancel requested", task_id)
            return TaskView(task_id=task_id, status=TaskState.running, phase=self.phase)
        if task_id in self._tasks:
            return self._tasks[task_id]
        raise NotFoundError(f"Task {task_id} is not known to this worker.")

    def task(self, task_id: str) -> TaskView:
        view = self._tasks.get(task_id)
        if view is None:
            raise NotFoundError(f"Task {task_id} is not known to this worker.")
        ctx = self._find(task_id)
        if view.status is TaskState.running and ctx is not None:
            p = ctx.snapshot()
            view = view.model_copy(update={"progress": p.percent, "phase": p.phase})
        return view

    # -- output files ---------------------------------------------------------------------------
    def remove_task_files(self, task_id: str) -> list[str]:
        """Delete one finished task's WAV/MP3/JSON (the dispatcher has copied them); returns the names removed.

        The names come from the remembered task, or, for a task this process no longer remembers
        (restarted, or evicted), from the JSON files that name it. Removing twice is not an error.
        """
        if self._find(task_id) is not None:
            raise RequestError(f"Task {task_id} is still running; its files can be removed once it ends.")
        view = self._tasks.get(task_id)
        if view is not None and view.result is not None:
            r = view.result
            names = [r.wav_filename, r.mp3_filename, r.json_filename]
        else:
            names = _names_from_metadata(self.s.output_dir, task_id)
            if not names and view is None:
                raise NotFoundError(f"Task {task_id} is not known to this worker and has no files.")
        removed = [n for n in names if _remove_output(self.s.output_dir, n)]
        log.info("task %s: removed %d output file(s)", task_id, len(removed))
        return removed

    def sweep_outputs(self) -> int:
        """The safety net: remove output files older than ``OUTPUT_TTL_SEC`` (a running task's are younger)."""
        if self.s.output_ttl_sec <= 0:
            return 0
        return sweep_outputs(self.s.output_dir, self.s.output_ttl_sec)

    # -- reporting ------------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        batch = list(self._batch)
        running = [c for c in batch if not c.cancelled()]
        ctx = running[0] if running else self._current
        progress, detail, phase, updated, quiet_sec, rate = 0, "", self.phase, None, 0.0, None
        if ctx is not None:
            p = ctx.snapshot()
            progress, detail, updated, rate = p.percent, p.detail, p.updated_at, p.rate
            quiet_sec = time.monotonic() - p.updated_mono  # a wall-clock step must not look like a stall
            if p.phase != "idle":
                phase = p.phase
        status = self.status.value
        if ctx is not None and quiet_sec > self.s.stall_timeout_sec:
            status = WorkerStatus.stalled.value  # the model thread made no progress past its deadline
        out = {
            "status": status,
            "accepting": self.accepting,
            "phase": phase,
            "gpu_id": self.s.gpu_id,
            "seed": self.s.seed,
            "progress": progress,
            "progress_detail": detail,  # the reference's "N/M tokens" in the backbone
            "tokens_per_sec": rate,
            "runtime_mode": self.s.runtime_mode,
            **self.pipeline.loaded(),
            "backbone_models": self._models["backbone_models"],
            "superres_models": self._models["superres_models"],
            "task_id": ctx.task_id if ctx else None,
            "last_progress_at": updated,
            "device": self.device.name,
            "rss_mb": round(rss_mb(), 1),
            "tasks_done": self.tasks_done,
            "uptime_sec": round(time.monotonic() - self._started_mono, 1),
            "error": self.error,
            **disk_report(self.s.output_dir, self.s.min_free_disk_mb),
            "batch_size": len(batch),
            "tasks": [_take_view(c) for c in batch],  # per take of the running batch
        }
        out.update(self.device.memory_mb())  # cuda_allocated_mb on CUDA
        return out


def _take_view(ctx: TaskContext) -> dict[str, Any]:
    p = ctx.snapshot()
    return {
        "task_id": ctx.task_id,
        "phase": p.phase,
        "progress": p.percent,
        "progress_detail": p.detail,
        "tokens_per_sec": p.rate,
        "cancelled": ctx.cancelled(),
        "last_progress_at": p.updated_at,
    }


def _is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def _shown(path: Path) -> str:
    """A folder as a client may see it: its last name only (the full path is in the worker's log)."""
    return f"…/{path.name}" if path.name else str(path)


def classify_failure(exc: BaseException, out_dir: Path, out_of_memory: bool = False) -> tuple[ErrorKind, str]:
    """(kind, sentence) for an unexpected task failure; never a bare exception class name for the disk.

    ``out_of_memory``: the device said ``exc`` is its framework's out-of-memory error (torch's).
    """
    if out_of_memory or _is_out_of_memory(exc):
        return ErrorKind.environment, "The worker ran out of memory."
    if isinstance(exc, OSError):
        where = Path(exc.filename) if exc.filename else out_dir
        inside = where == out_dir or out_dir in where.parents
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return ErrorKind.environment, f"The worker's output disk is full ({_shown(out_dir if inside else where)})."
        reason = exc.strerror or type(exc).__name__
        if inside:
            return (
                ErrorKind.environment,
                f"The worker could not write its output files in {_shown(out_dir)} ({reason}).",
            )
        return ErrorKind.environment, f"The worker hit a system error on {_shown(where)} ({reason})."
    return ErrorKind.model, f"The task failed inside the model ({type(exc).__name__})."


def _existing(path: Path) -> Path:
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def disk_report(out_dir: Path, min_free_mb: float) -> dict[str, Any]:
    """``/health``'s view of the output disk: free MB, whether it is below ``MIN_FREE_DISK_MB``, file count."""
    try:
        free_mb: float | None = round(shutil.disk_usage(_existing(out_dir)).free / 2**20, 1)
    except OSError:
        free_mb = None
    files = 0
    try:
        with os.scandir(out_dir) as it:
            files = sum(1 for e in it if e.is_file(follow_symlinks=False))
    except OSError:
        pass
    return {"disk_free_mb": free_mb, "disk_low": free_mb is None or free_mb < min_free_mb, "output_files": files}


def _remove_output(out_dir: Path, name: str) -> bool:
    """Remove one output file by plain name (no paths, no links, only export's suffixes)."""
    if not OUTPUT_NAME.match(name) or ".." in name or not name.endswith(OUTPUT_SUFFIXES):
        return False
    path = out_dir / name
    if path.is_symlink() or not path.is_file():
        return False
    path.unlink(missing_ok=True)
    return True


def _names_from_metadata(out_dir: Path, task_id: str) -> list[str]:
    """The files of ``task_id`` as recorded in its JSON (for tasks this process does not remember)."""
    found: list[str] = []
    try:
        entries = [e for e in os.scandir(out_dir) if e.name.endswith(".json") and not e.name.startswith(".")]
    except OSError:
        return found
    for entry in entries:
        try:
            meta = json.loads(Path(entry.path).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(meta, dict) and meta.get("task_id") == task_id:
            files = meta.get("files") or {}
            found += [str(files[k]) for k in ("wav", "mp3") if k in files] + [entry.name]
    return found


def sweep_outputs(out_dir: Path, ttl_sec: float, now: float | None = None) -> int:
    """Remove export's files in ``out_dir`` last changed more than ``ttl_sec`` ago; returns how many."""
    cutoff = (time.time() if now is None else now) - ttl_sec
    removed = 0
    try:
        entries = list(os.scandir(out_dir))
    except OSError:
        return 0
    for entry in entries:
        try:
            if entry.stat(follow_symlinks=False).st_mtime < cutoff and _remove_output(out_dir, entry.name):
                removed += 1
        except OSError as exc:
            log.warning("output sweep: could not remove %s: %s", entry.name, exc.strerror or exc)
    if removed:
        log.info("output sweep: removed %d file(s) older than %.0fs from %s", removed, ttl_sec, out_dir)
    return removed
