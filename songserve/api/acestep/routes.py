"""The dialect's routes: each reads its body as ACE-Step does, checks the key, calls one function, wraps.

Served at the root of ``ACESTEP_PORT``, so a client configured with ``http://host:PORT`` works as
against ACE-Step. docs/api.md ("ACE-Step's dialect") lists the routes and what each answers.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import FileResponse, JSONResponse

from songserve import __version__
from songserve.api.acestep.answers import query_item, unknown_item
from songserve.api.acestep.auth import check_body_or_header, check_header
from songserve.api.acestep.bodies import Body, read_bytes, release_body, small_body
from songserve.api.acestep.failures import field_error
from songserve.api.acestep.files import audio_file
from songserve.api.acestep.params import Params
from songserve.api.acestep.samples import format_input, random_sample
from songserve.api.acestep.stats import JobTally
from songserve.api.acestep.tasks import continue_from, find, source_take, submit
from songserve.api.acestep.translate import Context, Repaint, read_task
from songserve.api.acestep.wrapper import wrap
from songserve.api.keys import ApiKeys, Caller
from songserve.api.service import JobService
from songserve.api.uploads import upload_limit
from songserve.settings import DispatcherSettings

router = APIRouter()
SERVICE = "ACE-Step API (songserve)"
Authorization = Header(None)


def _service(request: Request) -> JobService:
    svc: JobService = request.app.state.host.state.service  # the dispatcher app's, made in its lifespan
    return svc


def _settings(request: Request) -> DispatcherSettings:
    s: DispatcherSettings = request.app.state.settings
    return s


def _keys(request: Request) -> ApiKeys:
    keys: ApiKeys = request.app.state.host.state.keys  # our port's keys (create_app read them)
    return keys


def _catalogue(request: Request) -> dict[str, dict[str, Any]]:
    tags: dict[str, dict[str, Any]] = request.app.state.host.state.tags
    return tags


async def _small(request: Request, authorization: str | None) -> tuple[Body, Caller | None]:
    s = _settings(request)
    body = small_body(request.headers.get("content-type"), await read_bytes(request, s.max_body_bytes))
    return body, check_body_or_header(_keys(request), body.fields, authorization)


def _task_ids(value: Any) -> list[str]:
    """``task_id_list``: an array, or a string holding one."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except ValueError:
            value = None
    if not isinstance(value, list):
        raise field_error("task_id_list", "must be a JSON array of task ids, or a string holding one")
    return [v if isinstance(v, str) else json.dumps(v) for v in value]


@router.post("/release_task")
async def release_task(request: Request, authorization: str | None = Authorization) -> JSONResponse:
    s, svc = _settings(request), _service(request)
    ct = request.headers.get("content-type")
    multipart = (ct or "").lower().startswith("multipart/")  # may carry a source audio: the upload cap
    body = release_body(ct, await read_bytes(request, upload_limit(s)[0] if multipart else s.max_body_bytes))
    caller = check_body_or_header(_keys(request), body.fields, authorization)
    ctx = Context(_catalogue(request), s.max_tracks, tuple(svc.dispatcher.fleet().backbone_models), s.strict_requests)
    task = read_task(Params(body.fields), body.uploads, ctx)
    if isinstance(task, Repaint):
        task = await continue_from(svc, task, caller)  # our retake of the source take from repainting_start
    elif task.source is not None:
        await source_take(svc, task.source, task.keys["src_audio_path"], caller)
    try:
        accepted = await submit(svc, task, caller)
    except BaseException:
        if task.upload_id is not None:  # the repaint's source was stored for it: nothing of a refusal stays
            await svc.uploads.delete(task.upload_id)
        raise
    data = {"task_id": accepted.job_id, "status": "queued", "queue_position": max(1, accepted.queue_position)}
    return JSONResponse(wrap(data, extra=task.extra()))


@router.post("/query_result")
async def query_result(request: Request, authorization: str | None = Authorization) -> JSONResponse:
    body, caller = await _small(request, authorization)
    svc = _service(request)
    items = []
    for task_id in _task_ids(body.fields.get("task_id_list", [])):
        found = await find(svc, task_id, caller)  # another key's task is unknown here
        items.append(query_item(task_id, *found) if found else unknown_item(task_id))
    return JSONResponse(wrap(items))


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    svc = _service(request)
    return JSONResponse(wrap({"status": "ok", "service": SERVICE, "version": __version__, "accepting": svc.accepting}))


@router.get("/v1/stats")
async def stats(request: Request, authorization: str | None = Authorization) -> JSONResponse:
    check_header(_keys(request), authorization)
    tally: JobTally = request.app.state.tally
    return JSONResponse(wrap(await tally.stats(_service(request))))


@router.get("/v1/models")
async def models(request: Request, authorization: str | None = Authorization) -> JSONResponse:
    check_header(_keys(request), authorization)
    names = list(_service(request).dispatcher.fleet().backbone_models)
    listed = [{"name": n, "is_default": i == 0} for i, n in enumerate(names)]
    return JSONResponse(wrap({"models": listed, "default_model": names[0] if names else None}))


@router.post("/create_random_sample")
async def create_random_sample(request: Request, authorization: str | None = Authorization) -> JSONResponse:
    body, _ = await _small(request, authorization)
    return JSONResponse(wrap(random_sample(str(body.fields.get("sample_type") or ""))))


@router.post("/format_input")
async def format_input_route(request: Request, authorization: str | None = Authorization) -> JSONResponse:
    body, _ = await _small(request, authorization)
    s = _settings(request)
    return JSONResponse(wrap(format_input(body.fields, _catalogue(request), s.lyrics_cleaning)))


@router.api_route("/v1/audio", methods=["GET", "HEAD"])
async def audio(
    request: Request, path: str = Query(..., max_length=200), authorization: str | None = Authorization
) -> FileResponse:
    caller = check_header(_keys(request), authorization)
    file, media = await audio_file(_service(request), path, caller)
    return FileResponse(file, media_type=media)
