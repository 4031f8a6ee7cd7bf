"""The dispatcher's routes (docs/api.md): each validates, calls one service method, shapes the answer.

Each takes the part it uses as a dependency (``deps.py``): jobs, uploads, adapters, usage, announcements, or
the read-only readings for the probes and reports."""

from __future__ import annotations

import re
from typing import Any

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse

from songserve.api import metrics
from songserve.api.http.deps import (
    AdaptersDep,
    AnnouncementsDep,
    JobsDep,
    KeysDep,
    ReadingsDep,
    TagsDep,
    UploadsDep,
    UsageDep,
    caller,
)
from songserve.api.service import job_list
from songserve.api.service.adapters import AdapterService
from songserve.api.service.announcements import Announcements
from songserve.api.service.job_service import JobService, TrackFile
from songserve.api.service.keys import ApiKeys
from songserve.api.service.live import LiveResponse
from songserve.api.service.readings import Readings
from songserve.api.service.uploads import UploadService
from songserve.api.service.usage import UsageService
from songserve.http.errors import error_response
from songserve.schemas import (
    MAX_WAIT_SEC,
    AdapterView,
    GenerateAccepted,
    GenerateRequest,
    JobList,
    JobView,
    UploadView,
    UsageView,
    WorkerAnnounced,
    WorkerAnnouncement,
)
from songserve.schemas.common import ADAPTER_PATTERN

router = APIRouter()


async def visible_job(job_id: str, request: Request, svc: JobService = JobsDep) -> None:
    """A job another API key made is not found here, as one that does not exist (``keys.py``: ``sees``)."""
    who = caller(request)
    if who is not None and not who.sees_all:
        await svc.visible(job_id, who)


OwnJob = [Depends(visible_job)]  # on every /job/{job_id} route


# A fixed ASCII text: the names themselves are in the body's ``ignored`` (a header cannot carry them safely).
IGNORED_WARNING = '299 songserve "unknown fields were ignored; the answer lists them in ignored"'
WAIT = re.compile(r"(?:^|,)\s*wait\s*=\s*\"?(\d{1,6})\"?\s*(?:[;,]|$)", re.IGNORECASE)


def prefer_wait(prefer: str | None) -> int | None:
    """``Prefer: wait=N`` (RFC 7240) as seconds, at most 60; None when not asked (or not readable: ignored)."""
    m = WAIT.search(prefer or "")
    return min(int(m.group(1)), MAX_WAIT_SEC) if m else None


@router.post(
    "/generate",
    response_model=GenerateAccepted,
    responses={202: {"model": GenerateAccepted, "description": "Prefer: wait=N and the job still runs after N s"}},
)
async def generate(
    req: GenerateRequest,
    request: Request,
    response: Response,
    idempotency_key: str | None = Header(None, max_length=200),
    prefer: str | None = Header(None, max_length=200, description="wait=N (≤ 60): answer when the job ends"),
    svc: JobService = JobsDep,
) -> Any:
    """Accept a job; with ``Prefer: wait=N``, answer its view (200) once it ended, or at N s 202."""
    accepted = await svc.submit(req, idempotency_key, caller(request))
    headers = {"Warning": IGNORED_WARNING} if accepted.ignored else {}
    if (wait := prefer_wait(prefer)) is None:
        response.headers.update(headers)
        return accepted
    headers["Preference-Applied"] = f"wait={wait}"
    view = await svc.wait_for_end(accepted.job_id, wait)
    if view is not None:
        return JSONResponse(view.model_dump(mode="json"), headers=headers)
    return JSONResponse(accepted.model_dump(mode="json"), status_code=202, headers=headers)


@router.get("/usage", response_model=UsageView)
async def usage(request: Request, use: UsageService = UsageDep) -> UsageView:
    """The caller's key: its limits and its use (the last hour's tracks, its unfinished jobs)."""
    return await use.view(caller(request))


@router.get("/jobs", response_model=JobList)
async def jobs(
    request: Request,
    limit: int = Query(job_list.DEFAULT_LIMIT, ge=1, le=job_list.MAX_LIMIT, description="jobs in one page"),
    cursor: str | None = Query(None, pattern=job_list.CURSOR_PATTERN, description="a page's next_cursor: older jobs"),
    svc: JobService = JobsDep,
) -> JobList:
    """The caller's jobs, newest first: its key's own, or every job for a key that sees all (or no keys)."""
    return await svc.jobs(caller(request), limit, cursor)


@router.get("/job/{job_id}", response_model=JobView, dependencies=OwnJob)
async def job(job_id: str, svc: JobService = JobsDep) -> JobView:
    return await svc.view(job_id)


@router.delete("/job/{job_id}", response_model=JobView, dependencies=OwnJob)
async def cancel(job_id: str, svc: JobService = JobsDep) -> JobView:
    return await svc.cancel(job_id)


# GET and HEAD as two routes each: one route with both methods gives both one OpenAPI operation id (a warning).
@router.get("/job/{job_id}/track/{idx}/render", dependencies=OwnJob)
@router.head("/job/{job_id}/track/{idx}/render", dependencies=OwnJob)
async def render(
    job_id: str,
    idx: int,
    format: str = Query("flac", max_length=8, description="flac, opus, mp3 or wav"),
    loudness: float | None = Query(None, description="integrated loudness in LUFS (EBU R128), -70 to -5"),
    start: float | None = Query(None, ge=0, description="seconds into the take"),
    end: float | None = Query(None, gt=0, description="seconds into the take"),
    svc: JobService = JobsDep,
) -> FileResponse:
    """The take in another format, at a loudness, over a time range; made once, then from the cache."""
    f, headers = await svc.render(job_id, idx, format, loudness, start, end)
    return FileResponse(
        f.path, media_type=f.media_type, filename=f.filename, content_disposition_type=f.disposition, headers=headers
    )


@router.head("/job/{job_id}/track/{idx}/stream", dependencies=OwnJob)
async def stream_head(
    job_id: str, idx: int, format: str = Query("mp3", max_length=8), svc: JobService = JobsDep
) -> Response:
    """What GET would answer, without the body (a live stream's generator is made, never started)."""
    got = await svc.stream(job_id, idx, format, listen=False)
    if isinstance(got, TrackFile):
        return FileResponse(
            got.path, media_type=got.media_type, filename=got.filename, content_disposition_type="inline"
        )
    return Response(media_type=got[0], headers={"Cache-Control": "no-cache"})


@router.get("/job/{job_id}/track/{idx}/stream", dependencies=OwnJob)
async def stream(
    job_id: str,
    idx: int,
    format: str = Query("mp3", max_length=8, description="mp3 (plays as it arrives) or wav (16-bit PCM)"),
    svc: JobService = JobsDep,
) -> Response:
    """The track from its start as it is made, to its end (``api/service/live.py``); once done, its final file."""
    got = await svc.stream(job_id, idx, format)
    if isinstance(got, TrackFile):
        return FileResponse(
            got.path, media_type=got.media_type, filename=got.filename, content_disposition_type="inline"
        )
    media, listening = got
    assert listening is not None
    headers = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}
    return LiveResponse(listening.chunks(), listening.leave, media_type=media, headers=headers)


@router.get("/job/{job_id}/track/{idx}/{kind}", dependencies=OwnJob)
@router.head("/job/{job_id}/track/{idx}/{kind}", dependencies=OwnJob)
async def track_file(job_id: str, idx: int, kind: str, svc: JobService = JobsDep) -> FileResponse:
    f = await svc.track_file(job_id, idx, kind)
    return FileResponse(f.path, media_type=f.media_type, filename=f.filename, content_disposition_type=f.disposition)


@router.get("/job/{job_id}/events", dependencies=OwnJob)
async def events(job_id: str, request: Request, svc: JobService = JobsDep) -> StreamingResponse:
    await svc.view(job_id)  # 404 before the stream starts
    return StreamingResponse(
        svc.events(job_id, request.is_disconnected),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
    )


# The form is read as it streams (UploadService.receive), not by FastAPI: this only documents it.
_UPLOAD_FILE = {
    "type": "string",
    "format": "binary",
    "description": "an audio file: WAV, FLAC, OGG, MP3, … (UPLOAD_MAX_MB at most)",
}
_UPLOAD_SCHEMA = {"type": "object", "required": ["file"], "properties": {"file": _UPLOAD_FILE}}
UPLOAD_FORM = {"content": {"multipart/form-data": {"schema": _UPLOAD_SCHEMA}}, "required": True}


@router.post("/uploads", response_model=UploadView, openapi_extra={"requestBody": UPLOAD_FORM})
async def upload(request: Request, uploads: UploadService = UploadsDep) -> UploadView:
    """Store a person's own audio and queue its encoding; continue from it with ``continue_from.upload_id``."""
    return await uploads.receive(request, caller(request))


@router.get("/uploads/{upload_id}", response_model=UploadView)
async def upload_view(upload_id: str, request: Request, uploads: UploadService = UploadsDep) -> UploadView:
    return await uploads.view(upload_id, caller(request))


@router.get("/uploads/{upload_id}/codes")
@router.head("/uploads/{upload_id}/codes")
async def upload_codes(upload_id: str, request: Request, uploads: UploadService = UploadsDep) -> FileResponse:
    path = await uploads.codes(upload_id, caller(request))
    return FileResponse(path, media_type="application/octet-stream", filename=f"{upload_id}.codes")


@router.delete("/uploads/{upload_id}", response_model=UploadView)
async def upload_delete(upload_id: str, request: Request, uploads: UploadService = UploadsDep) -> UploadView:
    return await uploads.delete(upload_id, caller(request))


@router.get("/status")
async def status(readings: Readings = ReadingsDep) -> dict[str, object]:
    return await readings.status()


@router.get("/tags")
async def tags(catalogue: dict[str, dict[str, Any]] = TagsDep) -> dict[str, dict[str, Any]]:
    return catalogue


@router.get("/health")
async def health(readings: Readings = ReadingsDep) -> dict[str, object]:
    return readings.health()


@router.get("/ready")
async def ready(request: Request, readings: Readings = ReadingsDep, keys: ApiKeys = KeysDep) -> JSONResponse:
    """Answered without a key (a load balancer's probe has none); the reason and the count, which name
    folders and the fleet's size, only to a caller with a key, or when the dispatcher has none."""
    ok, reason = readings.ready()
    told = not keys.enabled or keys.from_bearer(request.headers.get("authorization", "").encode()) is not None
    if not ok:
        return error_response(503, reason if told else "Not ready.")
    return JSONResponse({"status": "ready", **({"workers_ready": readings.workers_ready()} if told else {})})


@router.get("/adapters")
async def adapters(request: Request, adapters: AdapterService = AdaptersDep) -> dict[str, object]:
    """The LoRA adapters this fleet can serve to the caller: ``[{name, workers, resident_on, rank, targets,
    bytes, uploaded}]``, an upload with its ``owner`` (only to keys that see the owner's work)."""
    return {"adapters": await adapters.listing(caller(request))}


# Read as it streams (AdapterService.receive), not by FastAPI: this only documents it.
_ADAPTER_SCHEMA = {
    "type": "object",
    "required": ["name", "config", "weights"],
    "properties": {
        "name": {"type": "string", "pattern": ADAPTER_PATTERN, "description": "the adapter's name in the fleet"},
        "config": {"type": "string", "format": "binary", "description": "adapter_config.json (PEFT's)"},
        "weights": {"type": "string", "format": "binary", "description": "adapter_model.safetensors"},
    },
}
ADAPTER_FORM = {"content": {"multipart/form-data": {"schema": _ADAPTER_SCHEMA}}, "required": True}


@router.post("/adapters", status_code=201, response_model=AdapterView, openapi_extra={"requestBody": ADAPTER_FORM})
async def adapter_upload(request: Request, adapters: AdapterService = AdaptersDep) -> AdapterView:
    """Upload a LoRA adapter (a key allowed to: ``upload_adapters``); every worker checks it against its model."""
    return await adapters.receive(request, caller(request))


@router.delete("/adapters/{name}", response_model=AdapterView)
async def adapter_delete(name: str, request: Request, adapters: AdapterService = AdaptersDep) -> AdapterView:
    """Delete one of the caller's uploaded adapters, here and on every worker."""
    return await adapters.delete(name, caller(request))


@router.get("/config")
async def config(readings: Readings = ReadingsDep) -> dict[str, object]:
    return readings.config()


@router.get("/metrics", response_class=PlainTextResponse)
async def prom(readings: Readings = ReadingsDep) -> Response:
    return Response(readings.metrics(), media_type=metrics.CONTENT_TYPE)


@router.post("/workers", response_model=WorkerAnnounced)
async def announce(
    body: WorkerAnnouncement,
    authorization: str | None = Header(None),
    announcements: Announcements = AnnouncementsDep,
) -> WorkerAnnounced:
    """A worker started with ``--announce`` joins the pool (the worker token, not the API key)."""
    return await announcements.announce(body, authorization)


@router.delete("/workers/{worker_id}")
async def withdraw(
    worker_id: int, authorization: str | None = Header(None), announcements: Announcements = AnnouncementsDep
) -> dict[str, object]:
    return await announcements.withdraw(worker_id, authorization)
