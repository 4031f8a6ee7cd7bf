"""The dispatcher's routes (docs/api.md): each validates, calls one service method, shapes the answer."""

from __future__ import annotations

from fastapi import APIRouter, Depends, File, Header, Query, Request, UploadFile
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse

from songserve import __version__
from songserve.api import metrics
from songserve.api.service import JobService
from songserve.http_errors import error_response
from songserve.schemas import (
    GenerateAccepted,
    GenerateRequest,
    JobView,
    UploadView,
    WorkerAnnounced,
    WorkerAnnouncement,
)

router = APIRouter()


async def service(request: Request) -> JobService:
    """The service behind the routes. Async: FastAPI runs a sync dependency in a thread, a hop per request."""
    svc: JobService = request.app.state.service
    return svc


Service = Depends(service)


# A fixed ASCII text: the names themselves are in the body's ``ignored`` (a header cannot carry them safely).
IGNORED_WARNING = '299 songserve "unknown fields were ignored; the answer lists them in ignored"'


@router.post("/generate", response_model=GenerateAccepted)
async def generate(
    req: GenerateRequest,
    response: Response,
    idempotency_key: str | None = Header(None, max_length=200),
    svc: JobService = Service,
) -> GenerateAccepted:
    accepted = await svc.submit(req, idempotency_key)
    if accepted.ignored:
        response.headers["Warning"] = IGNORED_WARNING
    return accepted


@router.get("/job/{job_id}", response_model=JobView)
async def job(job_id: str, svc: JobService = Service) -> JobView:
    return await svc.view(job_id)


@router.delete("/job/{job_id}", response_model=JobView)
async def cancel(job_id: str, svc: JobService = Service) -> JobView:
    return await svc.cancel(job_id)


# GET and HEAD as two routes each: one route with both methods gives both one OpenAPI operation id (a warning).
@router.get("/job/{job_id}/track/{idx}/render")
@router.head("/job/{job_id}/track/{idx}/render")
async def render(
    job_id: str,
    idx: int,
    format: str = Query("flac", max_length=8, description="flac, opus, mp3 or wav"),
    loudness: float | None = Query(None, description="integrated loudness in LUFS (EBU R128), -70 to -5"),
    start: float | None = Query(None, ge=0, description="seconds into the take"),
    end: float | None = Query(None, gt=0, description="seconds into the take"),
    svc: JobService = Service,
) -> FileResponse:
    """The take in another format, at a loudness, over a time range; made once, then from the cache."""
    f, headers = await svc.render(job_id, idx, format, loudness, start, end)
    return FileResponse(
        f.path, media_type=f.media_type, filename=f.filename, content_disposition_type=f.disposition, headers=headers
    )


@router.get("/job/{job_id}/track/{idx}/{kind}")
@router.head("/job/{job_id}/track/{idx}/{kind}")
async def track_file(job_id: str, idx: int, kind: str, svc: JobService = Service) -> FileResponse:
    f = await svc.track_file(job_id, idx, kind)
    return FileResponse(f.path, media_type=f.media_type, filename=f.filename, content_disposition_type=f.disposition)


@router.get("/job/{job_id}/events")
async def events(job_id: str, request: Request, svc: JobService = Service) -> StreamingResponse:
    await svc.view(job_id)  # 404 before the stream starts
    return StreamingResponse(
        svc.events(job_id, request.is_disconnected),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
    )


@router.post("/uploads", response_model=UploadView)
async def upload(
    file: UploadFile = File(description="an audio file: WAV, FLAC, OGG, MP3, … (UPLOAD_MAX_MB at most)"),
    svc: JobService = Service,
) -> UploadView:
    """Store a person's own audio and queue its encoding; continue from it with ``continue_from.upload_id``."""
    return await svc.uploads.create(await file.read(), file.filename or "")


@router.get("/uploads/{upload_id}", response_model=UploadView)
async def upload_view(upload_id: str, svc: JobService = Service) -> UploadView:
    return await svc.uploads.view(upload_id)


@router.get("/uploads/{upload_id}/codes")
@router.head("/uploads/{upload_id}/codes")
async def upload_codes(upload_id: str, svc: JobService = Service) -> FileResponse:
    path = await svc.uploads.codes(upload_id)
    return FileResponse(path, media_type="application/octet-stream", filename=f"{upload_id}.codes")


@router.delete("/uploads/{upload_id}", response_model=UploadView)
async def upload_delete(upload_id: str, svc: JobService = Service) -> UploadView:
    return await svc.uploads.delete(upload_id)


@router.get("/status")
async def status(svc: JobService = Service) -> dict[str, object]:
    return await svc.status()


@router.get("/tags")
async def tags(request: Request) -> dict[str, dict[str, object]]:
    catalogue: dict[str, dict[str, object]] = request.app.state.tags
    return catalogue


@router.get("/health")
async def health(svc: JobService = Service) -> dict[str, object]:
    return {"status": "ok", "version": __version__, "accepting": svc.accepting}


@router.get("/ready")
async def ready(svc: JobService = Service) -> JSONResponse:
    ok, reason = svc.ready()
    if not ok:
        return error_response(503, reason)
    return JSONResponse({"status": "ready", "workers_ready": svc.workers_ready()})


@router.get("/config")
async def config(svc: JobService = Service) -> dict[str, object]:
    return svc.config()


@router.get("/metrics", response_class=PlainTextResponse)
async def prom(svc: JobService = Service) -> Response:
    return Response(svc.metrics(), media_type=metrics.CONTENT_TYPE)


@router.post("/workers", response_model=WorkerAnnounced)
async def announce(
    body: WorkerAnnouncement, authorization: str | None = Header(None), svc: JobService = Service
) -> WorkerAnnounced:
    """A worker started with ``--announce`` joins the pool (the worker token, not the API key)."""
    return await svc.announce(body, authorization)


@router.delete("/workers/{worker_id}")
async def withdraw(
    worker_id: int, authorization: str | None = Header(None), svc: JobService = Service
) -> dict[str, object]:
    return await svc.withdraw(worker_id, authorization)
