"""The worker's runtime: model lifecycle and the single model thread.

All model work (loading and generation) runs on one dedicated thread, so async routes keep
answering ``/health`` while a track generates. One task at a time; a second gets ``BusyError``.
Finished tasks are remembered (bounded) so a dispatcher that lost the connection can collect them.

States (``WorkerStatus``):  initializing → idle ⇄ busy;  any → error (loading failed / thread died).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import torch

from songserve.errors import (
    BusyError,
    CancelledError,
    ConfigError,
    NotFoundError,
    RequestError,
    SongserveError,
    TaskError,
    UnavailableError,
)
from songserve.pipeline.context import TaskContext
from songserve.pipeline.types import Pipeline, TrackRequest, TrackResult
from songserve.schemas import (
    TaskState,
    TaskView,
    WorkerGenerateRequest,
    WorkerGenerateResult,
    WorkerPhase,
    WorkerStatus,
)
from songserve.settings import WorkerSettings

log = logging.getLogger(__name__)
MAX_REMEMBERED_TASKS = 256


def pick_device(choice: str) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda was asked for, but CUDA is not available.")
        return torch.device("cuda", 0)  # the launcher's CUDA_VISIBLE_DEVICES picks the GPU
    return torch.device("cpu")


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
    def __init__(self, settings: WorkerSettings, pipeline: Pipeline, device: torch.device) -> None:
        self.s = settings
        self.pipeline = pipeline
        self.device = device
        self.status = WorkerStatus.initializing
        self.phase = WorkerPhase.idle.value
        self.error: str | None = None
        self.started_at = time.time()
        self.tasks_done = 0
        self.accepting = True
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self._lock = threading.Lock()
        self._current: TaskContext | None = None  # the first take of the running batch
        self._batch: list[TaskContext] = []  # every take of the running batch
        self._last_ids: list[str] = []
        self._tasks: OrderedDict[str, TaskView] = OrderedDict()
        pipeline.phase_hook = self._set_phase
        self._models = pipeline.describe()

    def _set_phase(self, phase: str) -> None:
        self.phase = phase

    # -- lifecycle ------------------------------------------------------------------------------
    def _load(self) -> None:
        torch.set_num_threads(self.s.torch_threads)
        t0 = time.perf_counter()
        self.pipeline.load()
        # Everything loaded so far lives as long as the process: keep it out of every later
        # garbage collection (a full collection over torch + megatron's objects takes ~0.2 s).
        gc.collect()
        gc.freeze()
        self.phase = WorkerPhase.idle.value
        log.info("models ready in %.1fs on %s (%s)", time.perf_counter() - t0, self.device, self.s.runtime_mode)

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
            seed = body.seed_override if body.seed_override is not None else self.s.seed
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
        if isinstance(got, CancelledError):
            log.info("task %s: cancelled after %.2fs", task_id, time.perf_counter() - t0)
            self._remember(
                TaskView(task_id=task_id, status=TaskState.cancelled, error=f"Task {task_id} was cancelled.")
            )
            return got
        if isinstance(got, SongserveError):
            self._remember(TaskView(task_id=task_id, status=TaskState.error, error=str(got)))
            return got
        if isinstance(got, BaseException):  # out of memory, encoder or disk errors: local to this task
            log.error("task %s: failed", task_id, exc_info=got)
            message = _task_error_sentence(got)
            self._remember(TaskView(task_id=task_id, status=TaskState.error, error=message))
            return TaskError(message)
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
        self._remember(TaskView(task_id=task_id, status=TaskState.ok, result=out, progress=100))
        log.info("task %s: done in %.2fs (%.2fs audio)", task_id, time.perf_counter() - t0, got.duration_sec)
        return out

    def _run(self, reqs: list[TrackRequest], ctxs: list[TaskContext]) -> list[TrackResult | BaseException]:
        """On the model thread. Pipelines without ``run_batch`` (the tone) run the takes in turn."""
        with torch.inference_mode():
            run_batch = getattr(self.pipeline, "run_batch", None)
            if run_batch is not None:
                return run_batch(reqs, ctxs)
            out: list[TrackResult | BaseException] = []
            for req, ctx in zip(reqs, ctxs, strict=True):
                try:
                    out.append(self.pipeline.run(req, ctx))
                except Exception as exc:  # noqa: BLE001 (kept per take)
                    out.append(exc)
            return out

    def _find(self, task_id: str) -> TaskContext | None:
        return next((c for c in self._batch if c.task_id == task_id), None)

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

    # -- reporting ------------------------------------------------------------------------------
    def health(self) -> dict:
        batch = list(self._batch)
        running = [c for c in batch if not c.cancelled()]
        ctx = running[0] if running else self._current
        progress, detail, phase, updated = 0, "", self.phase, None
        if ctx is not None:
            p = ctx.snapshot()
            progress, detail, updated = p.percent, p.detail, p.updated_at
            if p.phase != "idle":
                phase = p.phase
        status = self.status.value
        if ctx is not None and updated is not None and time.time() - updated > self.s.stall_timeout_sec:
            status = WorkerStatus.stalled.value  # the model thread made no progress past its deadline
        out = {
            "status": status,
            "accepting": self.accepting,
            "phase": phase,
            "gpu_id": self.s.gpu_id,
            "seed": self.s.seed,
            "progress": progress,
            "progress_detail": detail,
            "runtime_mode": self.s.runtime_mode,
            **self.pipeline.loaded(),
            "backbone_models": self._models["backbone_models"],
            "superres_models": self._models["superres_models"],
            "task_id": ctx.task_id if ctx else None,
            "last_progress_at": updated,
            "device": str(self.device),
            "rss_mb": round(rss_mb(), 1),
            "tasks_done": self.tasks_done,
            "uptime_sec": round(time.time() - self.started_at, 1),
            "error": self.error,
            "batch_size": len(batch),
            "tasks": [_take_view(c) for c in batch],  # per take of the running batch
        }
        if self.device.type == "cuda":
            out["cuda_allocated_mb"] = round(torch.cuda.memory_allocated() / 2**20, 1)
        return out


def _take_view(ctx: TaskContext) -> dict:
    p = ctx.snapshot()
    return {
        "task_id": ctx.task_id,
        "phase": p.phase,
        "progress": p.percent,
        "progress_detail": p.detail,
        "cancelled": ctx.cancelled(),
        "last_progress_at": p.updated_at,
    }


def _task_error_sentence(exc: BaseException) -> str:
    if isinstance(exc, torch.OutOfMemoryError | MemoryError):
        return "The task ran out of memory."
    if isinstance(exc, OSError):
        return f"The task could not write its files: {exc.strerror or type(exc).__name__}."
    return f"The task failed inside the model ({type(exc).__name__})."
