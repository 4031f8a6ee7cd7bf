"""The worker's HTTP surface (docs/api.md, "Worker"): thin routes over ``WorkerRuntime``.

``/health``, ``/config``, ``/generate``, ``/generate_batch``, ``/encode``, ``/tasks`` and ``/cancel``
answer models of ``songserve.schemas`` (``/tasks/{id}/stream``: a running take's live audio), serialised
by FastAPI; a take's result or failure becomes its answer in ``worker/to_pipeline.py``. Errors take the
one error body (``http_errors``). ``/encode`` takes an audio file as its raw body, up to ``MAX_AUDIO_MB``
(every other body: ``MAX_BODY_BYTES``), read from memory: nothing of it is written on the worker.

Besides the routes, a small background task sweeps output files past ``OUTPUT_TTL_SEC``; the
dispatcher removes each task's files with ``DELETE /files/{task_id}`` once it has copied them.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Header, Query, Request
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from songserve import __version__
from songserve.errors import BusyError, NotFoundError, RequestError, SongserveError
from songserve.http.errors import install_error_handlers
from songserve.http.forms import spool
from songserve.http.guard import BearerAuth, BodyLimit
from songserve.schemas import (
    ID_PATTERN,
    TaskView,
    WorkerBatchRequest,
    WorkerBatchResult,
    WorkerConfig,
    WorkerEncodeResult,
    WorkerGenerateRequest,
    WorkerGenerateResult,
    WorkerHealth,
    WorkerStatus,
    WorkerTakeFailure,
)
from songserve.worker.announce import Announcer
from songserve.worker.fence import HEADER, LeaseFences
from songserve.worker.live_stream import follow, open_live
from songserve.worker.runtime import WorkerRuntime
from songserve.worker.settings import WorkerSettings
from songserve.worker.to_pipeline import batch_result, generate_failure
from songserve.worker.urls import dispatcher_urls, local_health_url

log = logging.getLogger(__name__)
TASK_ID = re.compile(ID_PATTERN.replace("*", "{1,64}"))
PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}$")
GENRES = ["pop", "rock", "jazz", "electronic", "hip hop", "folk", "classical", "r&b", "country", "metal"]
LANGUAGES = ["en", "zh", "Instrumental"]


def safe_file(folder: Path, name: str) -> Path:
    """A plain file name directly inside ``folder``, not a link; anything else is not found."""
    if not PLAIN_NAME.match(name) or ".." in name:
        raise NotFoundError(f"File {name!r} not found.")
    path = folder / name
    if path.is_symlink() or not path.is_file() or path.resolve().parent != folder.resolve():
        raise NotFoundError(f"File {name!r} not found.")
    return path


def sweep_interval(ttl_sec: float) -> float:
    """How often to sweep: often enough for the TTL to hold within ~10 %, never busier than once a second."""
    return min(max(ttl_sec / 10, 1.0), 600.0)


async def sweep_loop(runtime: WorkerRuntime) -> None:
    """Remove old output files forever; one failed sweep is logged and the next one runs."""
    interval = sweep_interval(runtime.s.output_ttl_sec)
    while True:
        await asyncio.sleep(interval)
        try:
            await asyncio.to_thread(runtime.sweep_outputs)
        except Exception:
            log.exception("output sweep failed; retrying in %.0fs", interval)


def make_announcer(s: WorkerSettings) -> Announcer | None:
    """The announcer for ``ANNOUNCE`` (settings already checked the URLs and the token), or None."""
    if not s.announce:
        return None
    return Announcer(
        dispatcher_urls(s.announce),
        public_url=s.public_url,
        token=s.worker_token,
        interval_sec=s.announce_interval_sec,
        health_url=local_health_url(s.host, s.worker_port),
    )


def not_the_api(s: WorkerSettings) -> str:
    """What a person who reached a worker's port is told: this is a worker, and where clients go. (The
    API key's "send Authorization: Bearer <key>" read as "you need a key" here, which is not the fix.)"""
    where = ", ".join(dispatcher_urls(s.announce)) if s.announce else "its port, API_PORT, 8889 by default"
    return (
        f"This is a songserve worker (port {s.worker_port}), not the API: clients use the dispatcher ({where}); "
        "only a dispatcher calls this port, with the worker token (WORKER_TOKEN; one the launcher generated "
        "is in its LOG_DIR/worker_token)."
    )


def create_app(runtime: WorkerRuntime, on_load_failure: Callable[[Exception], None] | None = None) -> FastAPI:
    announcer = make_announcer(runtime.s)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async def load() -> None:
            try:
                await runtime.start()
            except Exception as exc:
                if on_load_failure:
                    on_load_failure(exc)

        task = asyncio.create_task(load())
        sweeper = asyncio.create_task(sweep_loop(runtime)) if runtime.s.output_ttl_sec > 0 else None
        if announcer is not None:
            announcer.start()  # waits for our own /health to answer, then registers with each dispatcher
        yield
        if announcer is not None:
            await announcer.stop()  # after the drain: leave where joined, so no dispatcher waits for the TTL
        task.cancel()
        if sweeper is not None:
            sweeper.cancel()
        runtime.shutdown()

    app = FastAPI(title="songserve worker", version=__version__, lifespan=lifespan)
    install_error_handlers(app)
    audio_bytes = int(runtime.s.max_audio_mb * 2**20)
    too_large = f"The audio file is larger than MAX_AUDIO_MB ({runtime.s.max_audio_mb:g} MB)."
    app.add_middleware(BodyLimit, max_bytes=runtime.s.max_body_bytes, paths={"/encode": (audio_bytes, too_large)})
    if runtime.s.worker_token:  # outside the body limit: no body is read before the token is checked
        app.add_middleware(
            BearerAuth,
            token=runtime.s.worker_token,
            exempt={"/health", "/"},
            realm="songserve-worker",
            refusal=not_the_api(runtime.s),
        )
    out_dir = runtime.s.output_dir
    fences = LeaseFences()  # a task from a dispatcher whose lease here passed on is refused (fence.py)
    Lease = Header(None, alias=HEADER, max_length=100)

    # /health and /config answer the fields the worker sets: a test tone has no parked stages or
    # CUDA memory (/health) and no context length (/config), and those fields stay off its answers.
    @app.get("/", include_in_schema=False)
    async def root() -> JSONResponse:
        """A browser pointed at a worker's port is told where the page and the API are."""
        return JSONResponse({"status": "ok", "service": "songserve worker", "note": not_the_api(runtime.s)})

    @app.get("/health", response_model_exclude_unset=True)
    async def health() -> WorkerHealth:
        return runtime.health()

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        return Response(runtime.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        h = runtime.health()
        ok = h.status in (WorkerStatus.idle.value, WorkerStatus.busy.value)
        body = {"ready": ok, "status": h.status, "device": h.device}
        return JSONResponse(
            body if ok else {**body, "status": "error", "error": f"Worker is {h.status}."},
            status_code=200 if ok else 503,
        )

    @app.get("/config", response_model_exclude_unset=True)
    async def config() -> WorkerConfig:
        d = runtime.pipeline.describe()
        return WorkerConfig(
            backbone_models=d["backbone_models"],
            superres_models=d["superres_models"],
            runtime_mode=runtime.s.runtime_mode,
            genre_options=GENRES,
            language_options=LANGUAGES,
            sample_rate=d["sample_rate"],
            frame_rate=d["frame_rate"],
            channels=d.get("channels", 2),
            formats=["wav", "mp3"],
            device=runtime.device.name,
            tiny_checkpoints=d.get("tiny_checkpoints", False),
            untrained=d.get("untrained", False),
            encoder=d.get("encoder", False),
            checkpoint_layout=d.get("checkpoint_layout"),  # extension: what was found where
            checkpoints=d.get("checkpoints", {}),
            architectures=d.get("architectures", {}),
            version=__version__,
            # ANNOUNCE: each dispatcher this worker registers with, and where it stands (joined, failing, …)
            announce=announcer.view() if announcer is not None else [],
            # limits for the dispatcher: refuse what cannot fit, pack takes up to max_batch
            # (the test tone runs a batch's takes in turn, so packing can be tested against it too)
            **runtime.pipeline.limits(),
        )

    # A finished take (status "ok") or a cancelled one (HTTP 200); a failure is an error body with its kind.
    @app.post("/generate", response_model=WorkerGenerateResult | WorkerTakeFailure)
    async def generate(
        body: WorkerGenerateRequest, lease: str | None = Lease
    ) -> WorkerGenerateResult | WorkerTakeFailure | JSONResponse:
        fences.check(lease, [body.task_id or "(no id)"])
        try:
            return await runtime.generate(body)
        except BusyError:
            raise  # the one busy answer (http_errors)
        except SongserveError as exc:
            return generate_failure(body.task_id, exc)

    @app.post("/generate_batch")
    async def generate_batch(body: WorkerBatchRequest, lease: str | None = Lease) -> WorkerBatchResult:
        """Several takes of one request as one batch (issue 14).

        Body ``{"takes": [<a /generate body>, …]}``: the takes differ only in ``seed_override``,
        ``task_id`` and ``track_index`` (else 400). The prompt is prefilled once, each take samples
        with its own seed, so a take draws what it would draw alone through ``/generate``; a batch
        larger than ``max_batch`` (or than free memory) runs as several batches in turn.
        Answer: ``{"status": "ok", "results": [...]}`` in the order of ``takes``, each a
        ``/generate`` result, or ``{"status": "cancelled"|"error", "task_id", "error"}`` for a take
        that was cancelled (``POST /cancel/{task_id}`` stops one take, the others go on) or failed.
        While it runs, ``/health`` lists every take under ``tasks`` with its own progress.
        A request that cannot be served at all (too long for the context, unknown model) is one 400.
        """
        fences.check(lease, [t.task_id or "(no id)" for t in body.takes])
        results = await runtime.generate_batch(body.takes)
        first = results[0][1]
        if isinstance(first, RequestError) and all(r is first for _, r in results):
            raise first
        return batch_result(results)

    @app.post("/encode")
    async def encode(
        request: Request,
        task_id: str = Query("", max_length=64, pattern=ID_PATTERN),
        lease: str | None = Lease,
    ) -> WorkerEncodeResult:
        """An audio file (the raw body: WAV, FLAC, OGG, MP3, …) as the codec's code grid; busy while it runs.

        A file that is not usable audio is a 400 naming the problem; a worker without an encoder 503."""
        fences.check(lease, [task_id or "(no id)"])
        body = await spool(request.stream(), audio_bytes, too_large)  # on disk past a megabyte, never whole in memory
        try:
            return await runtime.encode(body, task_id)
        finally:
            body.close()

    @app.post("/cancel/{task_id}")
    async def cancel(task_id: str) -> TaskView:
        return runtime.cancel(task_id)

    @app.get("/tasks/{task_id}")
    async def task(task_id: str, lease: str | None = Lease) -> TaskView:
        fences.note(lease)  # a new lease holder asking: what the old one sends from now on is refused
        return runtime.task(task_id)

    @app.get("/tasks/{task_id}/stream")
    async def live_stream(task_id: str, start: int = Query(0, ge=0, description="bytes already heard")) -> Response:
        """A running take's live audio: 16-bit PCM, 44.1 kHz stereo, as it is made (``live_stream.py``)."""
        ctx = open_live(runtime.tasks, task_id, runtime.s.preview_chunk_sec > 0, start)
        live = ctx.live
        headers = {
            "Cache-Control": "no-cache",
            "X-Sample-Rate": str(live.sample_rate),
            "X-Channels": str(live.channels),
        }
        chunks = follow(live, start, lambda: runtime.tasks.running(task_id) is ctx)
        return StreamingResponse(chunks, media_type="application/octet-stream", headers=headers)

    @app.delete("/files/{task_id}")
    async def remove_files(task_id: str) -> dict[str, Any]:
        """The dispatcher has copied this task's files: the worker deletes its own copies."""
        if not TASK_ID.match(task_id):
            raise NotFoundError(f"Task {task_id[:64]!r} is not known to this worker.")
        removed = await asyncio.to_thread(runtime.remove_task_files, task_id)
        return {"status": "ok", "task_id": task_id, "removed": removed}

    @app.get("/download/{filename}")
    async def download(filename: str) -> FileResponse:
        path = safe_file(out_dir, filename)
        media = {".wav": "audio/wav", ".mp3": "audio/mpeg", ".json": "application/json"}.get(
            path.suffix, "application/octet-stream"
        )
        return FileResponse(path, media_type=media, filename=path.name)

    return app
