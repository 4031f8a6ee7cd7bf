"""The worker's runtime: model lifecycle and the single model thread.

All model work (loading and generation) runs on one dedicated thread, so async routes keep
answering ``/health`` while a track generates. One batch at a time (a single task is a batch of
one); another gets ``BusyError``. The tasks it knows are ``worker/tasks.py``'s ``TaskRegistry``.

Its status (``WorkerStatus``) moves only along ``worker/states.py``'s table: initializing → idle ⇄
busy, initializing → error when loading fails; ``/health`` derives stalled. A batch and an encoding
claim the thread the same way (``_claim_ids``), end the same way (``_end``) and fail the same way
(``_failed``).

A failed task carries an ``ErrorKind`` (``worker/failures.py``), so the dispatcher may try another
worker when the fault is this one's. The worker reports its output disk in ``/health`` and removes
its own output files (``worker/outputs.py``). Stalls are measured on the monotonic clock.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any

from songserve.audio.reading import HOP, SAMPLE_RATE, AudioError, read_audio
from songserve.errors import (
    BusyError,
    NotFoundError,
    RequestError,
    SongserveError,
    TaskCancelled,
    UnavailableError,
)
from songserve.pipeline.context import TaskContext
from songserve.pipeline.types import EncodeResult, Pipeline, TrackRequest, TrackResult
from songserve.schemas import (
    MAX_PREFIX_FRAMES,
    ResultFile,
    TaskState,
    TaskView,
    WorkerEncodeResult,
    WorkerGenerateRequest,
    WorkerGenerateResult,
    WorkerHealth,
    WorkerPhase,
    WorkerStatus,
)
from songserve.worker.device import Device
from songserve.worker.failures import ClassifiedTaskError, classify_failure, error_kind_of
from songserve.worker.metrics import WorkerMetrics
from songserve.worker.outputs import disk_report, file_facts, names_from_metadata, remove_output, sweep_outputs
from songserve.worker.settings import WorkerSettings
from songserve.worker.states import check_transition
from songserve.worker.tasks import TaskRegistry
from songserve.worker.to_pipeline import encode_result, generate_result, track_request

log = logging.getLogger(__name__)


def rss_mb() -> float:
    """This process's resident memory in MiB (0 where ``/proc`` is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return 0.0


class WorkerRuntime:
    def __init__(self, settings: WorkerSettings, pipeline: Pipeline, device: Device) -> None:
        self.s = settings
        self.pipeline = pipeline
        self.device = device
        self._status = WorkerStatus.initializing
        self.phase = WorkerPhase.idle.value
        self.error: str | None = None
        self._started_mono = time.monotonic()
        self.tasks_done = 0
        self.accepting = True
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self._lock = threading.Lock()  # the status and the running batch change together
        self.tasks = TaskRegistry()
        self.metrics = WorkerMetrics()
        self.metrics.watch(self.health)
        pipeline.phase_hook = self._set_phase
        self._models = pipeline.describe()

    @property
    def status(self) -> WorkerStatus:
        return self._status

    @status.setter
    def status(self, new: WorkerStatus) -> None:
        """Every change of status passes the table (``states.check_transition``), or raises."""
        check_transition(self._status, new)
        self._status = new

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
        for ctx in list(self.tasks.batch):
            ctx.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)

    @property
    def model_thread_busy(self) -> bool:
        return self.tasks.current is not None

    async def drain(self, timeout: float) -> None:
        """SIGTERM: take no new task; let the running one finish for ``timeout``, else cancel it."""
        self.accepting = False
        ctx = self.tasks.current
        if ctx is None:
            return
        log.info("draining: waiting up to %.0fs for task %s", timeout, ctx.task_id)
        deadline = time.monotonic() + timeout
        while self.tasks.current is ctx and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.tasks.current is ctx:
            log.warning("task %s: cancelled by shutdown", ctx.task_id)
            for c in list(self.tasks.batch):
                c.cancel()
            deadline = time.monotonic() + 5
            while self.tasks.current is ctx and time.monotonic() < deadline:  # it answers "cancelled"
                await asyncio.sleep(0.05)

    # -- tasks ----------------------------------------------------------------------------------
    def _claim(self, bodies: list[WorkerGenerateRequest]) -> list[TaskContext]:
        """Register a batch's tasks, or raise why the worker cannot take it now."""
        for body in bodies:
            self.check_model_names(body)
        return self._claim_ids([b.task_id or uuid.uuid4().hex[:12] for b in bodies])

    def _claim_ids(self, ids: list[str]) -> list[TaskContext]:
        if not self.accepting:
            raise UnavailableError("The worker is shutting down and takes no new task.")
        if len(set(ids)) != len(ids):
            raise RequestError("The takes of a batch need distinct task_id values.")
        with self._lock:
            running = self.tasks.current
            if self.status is not WorkerStatus.idle:
                if self.status is WorkerStatus.busy and running is not None:
                    raise BusyError(f"The worker is already running task {running.task_id}.")
                raise BusyError(f"The worker is {self.status.value}, not ready for a task.")
            ctxs = self.tasks.begin(ids)
            self.status = WorkerStatus.busy
        return ctxs

    def _end(self) -> None:
        """A batch or an encoding is over, however it ended: no task runs, the worker is idle again."""
        with self._lock:
            self.tasks.end()
            self.phase = WorkerPhase.idle.value
            if self.status is WorkerStatus.busy:
                self.status = WorkerStatus.idle

    async def generate(self, body: WorkerGenerateRequest) -> WorkerGenerateResult:
        """One take: its result, or the exception that ended it (raised)."""
        _, out = (await self._generate([body]))[0]
        if isinstance(out, BaseException):
            raise out
        return out

    async def generate_batch(
        self, bodies: list[WorkerGenerateRequest]
    ) -> list[tuple[str, WorkerGenerateResult | SongserveError]]:
        """Several takes of one request as one batch; per take (task id, its result or its own error)."""
        return await self._generate(bodies)

    async def _generate(
        self, bodies: list[WorkerGenerateRequest]
    ) -> list[tuple[str, WorkerGenerateResult | SongserveError]]:
        ctxs = self._claim(bodies)
        reqs = [track_request(body, self.s.seed, ctx.task_id) for body, ctx in zip(bodies, ctxs, strict=True)]
        for body, req in zip(bodies, reqs, strict=True):
            log.info(
                "task %s: start (job %s track %d, %.2f min, seed %d, batch of %d)",
                req.task_id,
                body.job_id,
                body.track_index,
                body.duration,
                req.seed,
                len(bodies),
            )
        t0 = time.perf_counter()
        facts: list[dict[str, ResultFile]] = [{} for _ in ctxs]
        try:
            adapters = [b.adapter for b in bodies if b.adapter and b.adapter_scale]
            if adapters:  # read and checked here, off the model thread; the batch installs them
                await asyncio.to_thread(self.pipeline.prefetch_adapters, adapters)
            raw = await asyncio.get_running_loop().run_in_executor(self._executor, self._run, reqs, ctxs)
            # Read back off the event loop while the tasks still show running: /tasks and /cancel
            # must not find them gone before they are remembered as done.
            facts = await asyncio.to_thread(self._file_facts, raw)
        except Exception as exc:  # the whole batch failed (a request error, or the model)
            raw = [exc] * len(ctxs)
        finally:
            for ctx in ctxs:  # a listener that has the live file open reads on to its end
                ctx.live.remove()
            self._end()
        return [
            (ctx.task_id, self._settle(ctx.task_id, got, t0, files))
            for ctx, got, files in zip(ctxs, raw, facts, strict=True)
        ]

    async def encode(self, data: bytes | IO[bytes], task_id: str) -> WorkerEncodeResult:
        """An audio file's code grid (``POST /encode``): read off the event loop, encoded on the model thread.

        The file is refused (``RequestError``) before the model thread is claimed when it is not
        audio that can be used; the worker is busy for the encoding, as for a batch of takes."""
        try:
            audio, facts = await asyncio.to_thread(read_audio, data, MAX_PREFIX_FRAMES * HOP / SAMPLE_RATE)
        except AudioError as exc:
            raise RequestError(f"The audio file {exc}.") from None
        (ctx,) = self._claim_ids([task_id or uuid.uuid4().hex[:12]])
        t0 = time.perf_counter()
        try:
            got = await asyncio.get_running_loop().run_in_executor(self._executor, self._encode, audio, ctx)
        except SongserveError as exc:
            self.tasks.remember(TaskView(task_id=ctx.task_id, status=TaskState.error, error=str(exc)))
            raise
        except Exception as exc:
            raise self._failed(ctx.task_id, exc, "encoding failed") from None
        finally:
            self._end()
        self.tasks.remember(TaskView(task_id=ctx.task_id, status=TaskState.done, progress=100))
        elapsed = time.perf_counter() - t0
        log.info("task %s: encoded %.2f s of %s audio in %.2fs", ctx.task_id, facts.duration_sec, facts.format, elapsed)
        return encode_result(ctx.task_id, got, facts)

    def _encode(self, audio: object, ctx: TaskContext) -> EncodeResult:
        """On the model thread."""
        with self.device.inference():
            return self.pipeline.encode(audio, ctx)

    def _file_facts(self, raw: list[TrackResult | BaseException]) -> list[dict[str, ResultFile]]:
        """Each finished take's files, sized and checksummed as written (``{}`` for a take that failed)."""
        out_dir = self.s.output_dir
        return [
            file_facts(out_dir, [n for n in (r.wav_filename, r.mp3_filename, r.codes_filename, r.json_filename) if n])
            if isinstance(r, TrackResult)
            else {}
            for r in raw
        ]

    def _settle(
        self, task_id: str, got: TrackResult | BaseException, t0: float, files: dict[str, ResultFile]
    ) -> WorkerGenerateResult | SongserveError:
        """Record one take's outcome; return its result or its error (never raises)."""
        if isinstance(got, TaskCancelled):
            log.info("task %s: cancelled after %.2fs", task_id, time.perf_counter() - t0)
            self.tasks.remember(
                TaskView(task_id=task_id, status=TaskState.cancelled, error=f"Task {task_id} was cancelled.")
            )
            self.metrics.tasks.labels("cancelled").inc()
            return got
        if isinstance(got, SongserveError):
            kind = error_kind_of(got)
            log.warning("task %s: %s error: %s", task_id, kind.value if kind else "task", got)
            self.tasks.remember(TaskView(task_id=task_id, status=TaskState.error, error=str(got), error_kind=kind))
            self.metrics.tasks.labels(f"error_{kind.value}" if kind else "refused").inc()
            return got
        if isinstance(got, BaseException):  # out of memory, encoder or disk errors: local to this task
            failure = self._failed(task_id, got, "failed")
            self.metrics.tasks.labels(f"error_{failure.kind.value}").inc()
            return failure
        self.tasks_done += 1
        out = generate_result(task_id, got, self.s.gpu_id, files)
        self.tasks.remember(TaskView(task_id=task_id, status=TaskState.done, result=out, progress=100))
        log.info("task %s: done in %.2fs (%.2fs audio)", task_id, time.perf_counter() - t0, got.duration_sec)
        self.metrics.task_done(time.perf_counter() - t0, got.duration_sec, got.metadata.get("timings") or {})
        return out

    def _failed(self, task_id: str, exc: BaseException, what: str) -> ClassifiedTaskError:
        """A take or an encoding that failed unasked (out of memory, the model, the disk): logged with its
        traceback, its kind found (whose fault: ``failures.py``) and remembered; the error it answers."""
        log.error("task %s: %s", task_id, what, exc_info=exc)
        kind, message = classify_failure(exc, self.s.output_dir, self.device.is_out_of_memory(exc))
        self.tasks.remember(TaskView(task_id=task_id, status=TaskState.error, error=message, error_kind=kind))
        return ClassifiedTaskError(message, kind)

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

    def cancel(self, task_id: str) -> TaskView:
        return self.tasks.cancel(task_id, self.phase)

    def task(self, task_id: str) -> TaskView:
        return self.tasks.view(task_id)

    # -- uploaded adapters ----------------------------------------------------------------------
    async def upload_adapter(self, name: str, config: IO[bytes], weights: IO[bytes]) -> dict[str, Any]:
        """An uploaded adapter's two files, checked against the models as a folder adapter is at load
        and kept (``residency.AdapterStore.upload``); off the event loop and the model thread."""
        return await asyncio.to_thread(self.pipeline.upload_adapter, name, config, weights)

    async def remove_adapter(self, name: str, sha256: str | None = None) -> None:
        await asyncio.to_thread(self.pipeline.remove_adapter, name, sha256)

    # -- output files ---------------------------------------------------------------------------
    def remove_task_files(self, task_id: str) -> list[str]:
        """Delete one finished task's WAV/MP3/codes/JSON (the dispatcher has copied them); returns the names removed.

        The names come from the remembered task, or, for a task this process no longer remembers
        (restarted, or evicted), from the JSON files that name it. Removing twice is not an error.
        """
        if self.tasks.running(task_id) is not None:
            raise RequestError(f"Task {task_id} is still running; its files can be removed once it ends.")
        view = self.tasks.get(task_id)
        if view is not None and view.result is not None:
            r = view.result
            names = [n for n in (r.wav_filename, r.mp3_filename, r.codes_filename, r.json_filename) if n]
        else:
            names = names_from_metadata(self.s.output_dir, task_id)
            if not names and view is None:
                raise NotFoundError(f"Task {task_id} is not known to this worker and has no files.")
        removed = [n for n in names if remove_output(self.s.output_dir, n)]
        log.info("task %s: removed %d output file(s)", task_id, len(removed))
        return removed

    def sweep_outputs(self) -> int:
        """The safety net: remove output files older than ``OUTPUT_TTL_SEC`` (a running task's are younger)."""
        if self.s.output_ttl_sec <= 0:
            return 0
        return sweep_outputs(self.s.output_dir, self.s.output_ttl_sec)

    # -- reporting ------------------------------------------------------------------------------
    def health(self) -> WorkerHealth:
        """``/health``: this worker's state, the running take's progress, its disk and its models."""
        batch = list(self.tasks.batch)
        running = [c for c in batch if not c.cancelled()]
        ctx = running[0] if running else self.tasks.current
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
        return WorkerHealth(
            status=status,
            accepting=self.accepting,
            phase=phase,
            gpu_id=self.s.gpu_id,
            seed=self.s.seed,
            progress=progress,
            progress_detail=detail,  # the reference's "N/M tokens" in the backbone
            tokens_per_sec=rate,
            runtime_mode=self.s.runtime_mode,
            **self.pipeline.loaded(),
            backbone_models=self._models["backbone_models"],
            superres_models=self._models["superres_models"],
            task_id=ctx.task_id if ctx else None,
            last_progress_at=updated,
            device=self.device.name,
            rss_mb=round(rss_mb(), 1),
            tasks_done=self.tasks_done,
            uptime_sec=round(time.monotonic() - self._started_mono, 1),
            error=self.error,
            **disk_report(self.s.output_dir, self.s.min_free_disk_mb),
            batch_size=len(batch),
            tasks=self.tasks.take_health(),  # per take of the running batch
            **self.device.memory_mb(),  # cuda_allocated_mb on CUDA
            **({"launch_nonce": self.s.launch_nonce} if self.s.launch_nonce else {}),
        )
