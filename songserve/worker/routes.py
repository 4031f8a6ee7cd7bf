"""The worker's routes (docs/api.md, "Worker"), by concern: each validates, calls the runtime, shapes the answer.

Three routers, included by ``app.py`` in this order: status (``/``, ``/health``, ``/metrics``,
``/ready``, ``/config``), tasks (``/generate``, ``/generate_batch``, ``/encode``, ``/cancel``,
``/tasks``, a running take's live audio) and files (the dispatcher's removal of a task's files,
``/download``, and the adapters it uploads: ``PUT`` and ``DELETE /adapters/{name}``). What a route needs is a dependency read from the application's state (the
``WorkerRuntime``, the lease fences, the announcer), as the dispatcher's routes take its service.
A take's result or failure becomes its answer in ``worker/to_pipeline.py``; errors take the one
error body (``http/errors.py``).
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from songserve import __version__
from songserve.errors import BusyError, FieldError, NotFoundError, RequestError, SongserveError
from songserve.http.forms import FormLimits, read_form, spool
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
from songserve.schemas.continuation import MAX_REPAINT_PARTS
from songserve.worker.announce import Announcer
from songserve.worker.fence import HEADER, LeaseFences
from songserve.worker.live_stream import follow, open_live
from songserve.worker.runtime import WorkerRuntime
from songserve.worker.settings import WorkerSettings
from songserve.worker.to_pipeline import batch_result, generate_failure
from songserve.worker.urls import dispatcher_urls

TASK_ID = re.compile(ID_PATTERN.replace("*", "{1,64}"))
PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}$")
GENRES = ["pop", "rock", "jazz", "electronic", "hip hop", "folk", "classical", "r&b", "country", "metal"]
LANGUAGES = ["en", "zh", "Instrumental"]
FORM_SLACK = 64 * 1024  # bytes of a multipart body beyond its files: boundaries, headers, the name
ADAPTER_FORM = "is required: send the adapter as multipart/form-data files config and weights"

status_routes = APIRouter()
task_routes = APIRouter()
file_routes = APIRouter()
ROUTERS = (status_routes, task_routes, file_routes)  # the order of the routes, as the OpenAPI document lists them


# -- dependencies: what the application holds (app.py sets them once) ---------------------------------
# Async: FastAPI runs a sync dependency in a thread, a hop per request.
async def runtime(request: Request) -> WorkerRuntime:
    """The runtime behind every route."""
    rt: WorkerRuntime = request.app.state.runtime
    return rt


async def fences(request: Request) -> LeaseFences:
    """The worker's own fence (``fence.py``): a task from a dispatcher whose lease here passed on is refused."""
    f: LeaseFences = request.app.state.fences
    return f


async def announcer(request: Request) -> Announcer | None:
    """The announcer for ``ANNOUNCE``, or None."""
    a: Announcer | None = request.app.state.announcer
    return a


Runtime = Depends(runtime)
Fences = Depends(fences)
Lease = Header(None, alias=HEADER, max_length=100)


# -- pure helpers -----------------------------------------------------------------------------------
def safe_file(folder: Path, name: str) -> Path:
    """A plain file name directly inside ``folder``, not a link; anything else is not found."""
    if not PLAIN_NAME.match(name) or ".." in name:
        raise NotFoundError(f"File {name!r} not found.")
    path = folder / name
    if path.is_symlink() or not path.is_file() or path.resolve().parent != folder.resolve():
        raise NotFoundError(f"File {name!r} not found.")
    return path


def not_the_api(s: WorkerSettings) -> str:
    """What a person who reached a worker's port is told: this is a worker, and where clients go. (The
    API key's "send Authorization: Bearer <key>" read as "you need a key" here, which is not the fix.)"""
    where = ", ".join(dispatcher_urls(s.announce)) if s.announce else "its port, API_PORT, 8889 by default"
    return (
        f"This is a songserve worker (port {s.worker_port}), not the API: clients use the dispatcher ({where}); "
        "only a dispatcher calls this port, with the worker token (WORKER_TOKEN; one the launcher generated "
        "is in its LOG_DIR/worker_token)."
    )


def adapter_limit(s: WorkerSettings) -> tuple[int, str]:
    """``PUT /adapters/{name}``'s body limit in bytes (``ADAPTER_MAX_MB``, both files) and its 413's sentence."""
    said = f"The adapter is larger than ADAPTER_MAX_MB ({s.adapter_max_mb:g} MB); nothing was kept."
    return int(s.adapter_max_mb * 2**20) + FORM_SLACK, said


def audio_limit(s: WorkerSettings) -> tuple[int, str]:
    """``/encode``'s body limit in bytes (``MAX_AUDIO_MB``) and the sentence that refuses a larger one."""
    return int(s.max_audio_mb * 2**20), f"The audio file is larger than MAX_AUDIO_MB ({s.max_audio_mb:g} MB)."


# -- status: what the worker is and can do ------------------------------------------------------------
# /health and /config answer the fields the worker sets: a test tone has no parked stages or
# CUDA memory (/health) and no context length (/config), and those fields stay off its answers.
@status_routes.get("/", include_in_schema=False)
async def root(rt: WorkerRuntime = Runtime) -> JSONResponse:
    """A browser pointed at a worker's port is told where the page and the API are."""
    return JSONResponse({"status": "ok", "service": "songserve worker", "note": not_the_api(rt.s)})


@status_routes.get("/health", response_model_exclude_unset=True)
async def health(rt: WorkerRuntime = Runtime) -> WorkerHealth:
    return rt.health()


@status_routes.get("/metrics", response_class=PlainTextResponse)
async def metrics(rt: WorkerRuntime = Runtime) -> Response:
    return Response(rt.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@status_routes.get("/ready")
async def ready(rt: WorkerRuntime = Runtime) -> JSONResponse:
    h = rt.health()
    ok = h.status in (WorkerStatus.idle.value, WorkerStatus.busy.value)
    body = {"ready": ok, "status": h.status, "device": h.device}
    return JSONResponse(
        body if ok else {**body, "status": "error", "error": f"Worker is {h.status}."},
        status_code=200 if ok else 503,
    )


@status_routes.get("/config", response_model_exclude_unset=True)
async def config(rt: WorkerRuntime = Runtime, joined: Announcer | None = Depends(announcer)) -> WorkerConfig:
    d = rt.pipeline.describe()
    return WorkerConfig(
        backbone_models=d["backbone_models"],
        superres_models=d["superres_models"],
        runtime_mode=rt.s.runtime_mode,
        genre_options=GENRES,
        language_options=LANGUAGES,
        sample_rate=d["sample_rate"],
        frame_rate=d["frame_rate"],
        channels=d.get("channels", 2),
        formats=["wav", "mp3"],
        device=rt.device.name,
        tiny_checkpoints=d.get("tiny_checkpoints", False),
        untrained=d.get("untrained", False),
        encoder=d.get("encoder", False),
        checkpoint_layout=d.get("checkpoint_layout"),  # extension: what was found where
        checkpoints=d.get("checkpoints", {}),
        architectures=d.get("architectures", {}),
        version=__version__,
        repaint_parts=MAX_REPAINT_PARTS,  # both pipelines write every part of PrefixCodes.parts
        # ANNOUNCE: each dispatcher this worker registers with, and where it stands (joined, failing, …)
        announce=joined.view() if joined is not None else [],
        # limits for the dispatcher: refuse what cannot fit, pack takes up to max_batch
        # (the test tone runs a batch's takes in turn, so packing can be tested against it too)
        **rt.pipeline.limits(),
    )


# -- tasks: the work a dispatcher sends, and what it asks about it ---------------------------------------
# A finished take (status "ok") or a cancelled one (HTTP 200); a failure is an error body with its kind.
@task_routes.post("/generate", response_model=WorkerGenerateResult | WorkerTakeFailure)
async def generate(
    body: WorkerGenerateRequest,
    lease: str | None = Lease,
    rt: WorkerRuntime = Runtime,
    fence: LeaseFences = Fences,
) -> WorkerGenerateResult | WorkerTakeFailure | JSONResponse:
    fence.check(lease, [body.task_id or "(no id)"])
    try:
        return await rt.generate(body)
    except BusyError:
        raise  # the one busy answer (http/errors.py)
    except SongserveError as exc:
        return generate_failure(body.task_id, exc)


@task_routes.post("/generate_batch")
async def generate_batch(
    body: WorkerBatchRequest,
    lease: str | None = Lease,
    rt: WorkerRuntime = Runtime,
    fence: LeaseFences = Fences,
) -> WorkerBatchResult:
    """Several takes of one request as one batch.

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
    fence.check(lease, [t.task_id or "(no id)" for t in body.takes])
    results = await rt.generate_batch(body.takes)
    first = results[0][1]
    if isinstance(first, RequestError) and all(r is first for _, r in results):
        raise first
    return batch_result(results)


@task_routes.post("/encode")
async def encode(
    request: Request,
    task_id: str = Query("", max_length=64, pattern=ID_PATTERN),
    lease: str | None = Lease,
    rt: WorkerRuntime = Runtime,
    fence: LeaseFences = Fences,
) -> WorkerEncodeResult:
    """An audio file (the raw body: WAV, FLAC, OGG, MP3, …) as the codec's code grid; busy while it runs.

    A file that is not usable audio is a 400 naming the problem; a worker without an encoder 503."""
    fence.check(lease, [task_id or "(no id)"])
    audio_bytes, too_large = audio_limit(rt.s)
    body = await spool(request.stream(), audio_bytes, too_large)  # on disk past a megabyte, never whole in memory
    try:
        return await rt.encode(body, task_id)
    finally:
        body.close()


@task_routes.post("/cancel/{task_id}")
async def cancel(task_id: str, rt: WorkerRuntime = Runtime) -> TaskView:
    return rt.cancel(task_id)


@task_routes.get("/tasks/{task_id}")
async def task(
    task_id: str, lease: str | None = Lease, rt: WorkerRuntime = Runtime, fence: LeaseFences = Fences
) -> TaskView:
    fence.note(lease)  # a new lease holder asking: what the old one sends from now on is refused
    return rt.task(task_id)


@task_routes.get("/tasks/{task_id}/stream")
async def live_stream(
    task_id: str,
    start: int = Query(0, ge=0, description="bytes already heard"),
    rt: WorkerRuntime = Runtime,
) -> Response:
    """A running take's live audio: 16-bit PCM, 44.1 kHz stereo, as it is made (``live_stream.py``)."""
    ctx = open_live(rt.tasks, task_id, rt.s.preview_chunk_sec > 0, start)
    live = ctx.live
    headers = {
        "Cache-Control": "no-cache",
        "X-Sample-Rate": str(live.sample_rate),
        "X-Channels": str(live.channels),
    }
    chunks = follow(live, start, lambda: rt.tasks.running(task_id) is ctx)
    return StreamingResponse(chunks, media_type="application/octet-stream", headers=headers)


# -- files: a task's output files ------------------------------------------------------------------------
@file_routes.delete("/files/{task_id}")
async def remove_files(task_id: str, rt: WorkerRuntime = Runtime) -> dict[str, Any]:
    """The dispatcher has copied this task's files: the worker deletes its own copies."""
    if not TASK_ID.match(task_id):
        raise NotFoundError(f"Task {task_id[:64]!r} is not known to this worker.")
    removed = await asyncio.to_thread(rt.remove_task_files, task_id)
    return {"status": "ok", "task_id": task_id, "removed": removed}


@file_routes.get("/download/{filename}")
async def download(filename: str, rt: WorkerRuntime = Runtime) -> FileResponse:
    path = safe_file(rt.s.output_dir, filename)
    media = {".wav": "audio/wav", ".mp3": "audio/mpeg", ".json": "application/json"}.get(
        path.suffix, "application/octet-stream"
    )
    return FileResponse(path, media_type=media, filename=path.name)


@file_routes.put("/adapters/{name}")
async def put_adapter(name: str, request: Request, rt: WorkerRuntime = Runtime) -> dict[str, Any]:
    """An adapter the dispatcher uploads (multipart: files ``config`` and ``weights``): checked against
    this worker's models as a folder adapter is at load, then kept in ``ADAPTER_UPLOADS_DIR``, replacing
    one of that name. A refusal is a 422 naming the file and the reason (nothing is kept), a name of
    ``ADAPTERS_DIR`` a 409."""
    content_type = request.headers.get("content-type", "")
    if not content_type.lower().startswith("multipart/form-data"):
        raise FieldError("config", ADAPTER_FORM)
    limit, too_large = adapter_limit(rt.s)
    form = await read_form(request.stream(), content_type, FormLimits(limit, 4096, limit, too_large))
    try:
        for part in ("config", "weights"):
            if part not in form.files:
                raise FieldError(part, ADAPTER_FORM)
        return {"status": "ok", **await rt.upload_adapter(name, form.files["config"].file, form.files["weights"].file)}
    finally:
        form.close()


@file_routes.delete("/adapters/{name}")
async def delete_adapter(
    name: str,
    sha256: str | None = Query(
        None, pattern="^[0-9a-f]{64}$", description="remove only the copy whose weights have this SHA-256"
    ),
    rt: WorkerRuntime = Runtime,
) -> dict[str, Any]:
    """Remove an uploaded adapter (a batch running with it ends with it); 404 when there is none. With
    ``sha256``, only that copy: a 409 keeps another (a newer upload of the name, sent by another
    dispatcher of the fleet meanwhile)."""
    await rt.remove_adapter(name, sha256)
    return {"status": "ok", "name": name, "removed": True}
