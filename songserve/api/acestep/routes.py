"""The dialect's routes: each checks the key, reads its body as ACE-Step does, calls one function, wraps.

Served at the root of ``ACESTEP_PORT``, so a client configured with ``http://host:PORT`` works as
against ACE-Step. docs/api.md ("ACE-Step's dialect") lists the routes and what each answers. Each
route takes the parts it uses as dependencies, from the dispatcher app's parts (``compose.Parts``,
made in that app's lifespan): the job service, the upload service, the read-only readings.
"""

from __future__ import annotations

import json
from contextlib import AsyncExitStack
from typing import Any

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import FileResponse, JSONResponse

from songserve import __version__
from songserve.api.acestep.answers import query_item, unknown_item
from songserve.api.acestep.auth import check_body_or_header, check_header, header_caller
from songserve.api.acestep.bodies import Body, is_multipart, read_bytes, release_body, small_body, stream_multipart
from songserve.api.acestep.failures import AceError, field_error
from songserve.api.acestep.files import audio_file
from songserve.api.acestep.lora import LoraSession, LoraSessions, adapter_name, scale_of, toggle_of
from songserve.api.acestep.params import Params
from songserve.api.acestep.samples import format_input, random_sample
from songserve.api.acestep.stats import JobTally
from songserve.api.acestep.tasks import continue_from, find, source_take, submit
from songserve.api.acestep.translate import Context, Repaint, read_task
from songserve.api.acestep.wrapper import wrap
from songserve.api.http.deps import JobsDep, ReadingsDep, UploadsDep, parts
from songserve.api.service.job_service import JobService
from songserve.api.service.keys import ApiKeys, Caller
from songserve.api.service.readings import Readings
from songserve.api.service.uploads import UploadService, upload_limit
from songserve.api.settings import DispatcherSettings
from songserve.http.forms import FormLimits

router = APIRouter()
SERVICE = "ACE-Step API (songserve)"
Authorization = Header(None)


def _settings(request: Request) -> DispatcherSettings:
    s: DispatcherSettings = request.app.state.settings
    return s


def _keys(request: Request) -> ApiKeys:
    return parts(request).keys  # our port's keys


def _catalogue(request: Request) -> dict[str, dict[str, Any]]:
    return parts(request).tags


async def _authorized(
    request: Request,
    authorization: str | None,
    files: bool,
    line: AsyncExitStack | None = None,
    uploads: UploadService | None = None,
) -> tuple[Body, Caller | None]:
    """The body and its caller, the key checked before the body is read: a key in the header lets a
    multipart body of ``/release_task`` (``files``) up to the upload cap in; without one, the body may
    still carry ``ai_token``, so it is read only up to ``MAX_BODY_BYTES`` (a longer one is a 401 unread).
    A multipart body for ``line`` takes its place in the line of ``uploads`` (``UploadGate``) once the header
    passed and before a byte is read, held until ``line`` closes (503 with ``Retry-After`` when full)."""
    s, keys = _settings(request), _keys(request)
    ct = request.headers.get("content-type")
    small = s.max_body_bytes
    large, too_large = upload_limit(s) if files and is_multipart(ct) else (small, "")
    trusted = not keys.enabled or header_caller(keys, authorization) is not None
    limit = large if trusted else small
    declared = request.headers.get("content-length", "")
    try:
        if not trusted and declared.isdigit() and int(declared) > small:
            raise _Unread
        if line is not None and uploads is not None and is_multipart(ct):
            await line.enter_async_context(uploads.gate.ticket())
        if is_multipart(ct):
            form = FormLimits(limit, small, int(s.upload_max_mb * 2**20), too_large if trusted else "")
            body = await stream_multipart(request, form)
        else:
            raw = await read_bytes(request, limit)
            body = release_body(ct, raw) if files else small_body(ct, raw)
    except (_Unread, AceError) as exc:
        if not trusted and (isinstance(exc, _Unread) or exc.http_status == 413):
            raise _unread_refusal(keys, authorization, small) from None
        raise
    if not files:
        body.close()  # the other routes take no file: a file part sent to them is dropped at once
    try:
        return body, check_body_or_header(keys, body.fields, authorization)
    except BaseException:
        body.close()
        raise


def _unread_refusal(keys: ApiKeys, authorization: str | None, small: int) -> AceError:
    """ACE-Step's 401 for the header as sent, saying why the body's ``ai_token`` was not looked at."""
    try:
        check_body_or_header(keys, {}, authorization)
    except AceError as exc:
        return AceError(
            401,
            f"{exc} (a body over MAX_BODY_BYTES, {small} bytes, is read only with a key in the Authorization header)",
        )
    return AceError(401, "Missing or wrong Authorization header")


class _Unread(Exception):
    """A body too large to be read without a key in the header."""


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
async def release_task(
    request: Request,
    authorization: str | None = Authorization,
    svc: JobService = JobsDep,
    uploads: UploadService = UploadsDep,
    readings: Readings = ReadingsDep,
) -> JSONResponse:
    s = _settings(request)
    async with AsyncExitStack() as line:  # a multipart body may carry a source audio: a place in the uploads' line
        body, caller = await _authorized(request, authorization, files=True, line=line, uploads=uploads)
        try:
            models = tuple(readings.fleet().backbone_models)
            ctx = Context(_catalogue(request), s.max_tracks, models, s.strict_requests)
            return await _release(svc, uploads, ctx, body, caller, _session(request, caller))
        finally:
            body.close()


async def _release(
    svc: JobService, uploads: UploadService, ctx: Context, body: Body, caller: Caller | None, lora: LoraSession
) -> JSONResponse:
    task = read_task(Params(body.fields), body.uploads, ctx)
    if isinstance(task, Repaint):
        task = await continue_from(svc, uploads, task, caller)  # our retake of the source take from repainting_start
    elif task.source is not None:
        await source_take(svc, task.source, task.keys["src_audio_path"], caller)
    if (chosen := lora.applies()) is not None:  # the key's /v1/lora session: its adapter for this task
        task.request = task.request.model_copy(update={"adapter": chosen[0], "adapter_scale": chosen[1]})
    try:
        accepted = await submit(svc, task, caller)
    except BaseException:
        if task.upload_id is not None:  # the repaint's source was stored for it: nothing of a refusal stays
            await uploads.delete(task.upload_id)
        raise
    data = {"task_id": accepted.job_id, "status": "queued", "queue_position": max(1, accepted.queue_position)}
    return JSONResponse(wrap(data, extra=task.extra()))


@router.post("/query_result")
async def query_result(
    request: Request, authorization: str | None = Authorization, svc: JobService = JobsDep
) -> JSONResponse:
    body, caller = await _authorized(request, authorization, files=False)
    items = []
    for task_id in _task_ids(body.fields.get("task_id_list", [])):
        found = await find(svc, task_id, caller)  # another key's task is unknown here
        items.append(query_item(task_id, *found) if found else unknown_item(task_id))
    return JSONResponse(wrap(items))


@router.get("/health")
async def health(readings: Readings = ReadingsDep) -> JSONResponse:
    accepting = readings.accepting
    return JSONResponse(wrap({"status": "ok", "service": SERVICE, "version": __version__, "accepting": accepting}))


@router.get("/v1/stats")
async def stats(
    request: Request,
    authorization: str | None = Authorization,
    svc: JobService = JobsDep,
    readings: Readings = ReadingsDep,
) -> JSONResponse:
    check_header(_keys(request), authorization)
    tally: JobTally = request.app.state.tally
    return JSONResponse(wrap(await tally.stats(svc, readings)))


@router.get("/v1/models")
async def models(
    request: Request, authorization: str | None = Authorization, readings: Readings = ReadingsDep
) -> JSONResponse:
    check_header(_keys(request), authorization)
    names = list(readings.fleet().backbone_models)
    listed = [{"name": n, "is_default": i == 0} for i, n in enumerate(names)]
    return JSONResponse(wrap({"models": listed, "default_model": names[0] if names else None}))


@router.post("/create_random_sample")
async def create_random_sample(request: Request, authorization: str | None = Authorization) -> JSONResponse:
    body, _ = await _authorized(request, authorization, files=False)
    return JSONResponse(wrap(random_sample(str(body.fields.get("sample_type") or ""))))


@router.post("/format_input")
async def format_input_route(request: Request, authorization: str | None = Authorization) -> JSONResponse:
    body, _ = await _authorized(request, authorization, files=False)
    s = _settings(request)
    return JSONResponse(wrap(format_input(body.fields, _catalogue(request), s.lyrics_cleaning)))


@router.api_route("/v1/audio", methods=["GET", "HEAD"])
async def audio(
    request: Request,
    path: str = Query(..., max_length=200),
    authorization: str | None = Authorization,
    svc: JobService = JobsDep,
) -> FileResponse:
    caller = check_header(_keys(request), authorization)
    file, media = await audio_file(svc, path, caller)
    return FileResponse(file, media_type=media)


# ---- /v1/lora/*: the calling key's adapter for its later tasks (``lora.py``) ------------------------------
def _session(request: Request, caller: Caller | None) -> LoraSession:
    sessions: LoraSessions = request.app.state.lora
    return sessions.of(caller.name if caller is not None else "")


async def _lora_call(request: Request, authorization: str | None) -> tuple[dict[str, Any], LoraSession]:
    body, caller = await _authorized(request, authorization, files=False)
    return body.fields, _session(request, caller)


@router.post("/v1/lora/load")
async def lora_load(request: Request, authorization: str | None = Authorization) -> JSONResponse:
    body, caller = await _authorized(request, authorization, files=False)
    fields, session = body.fields, _session(request, caller)
    offered = await parts(request).adapters.usable(caller)  # another key's upload is as unknown as no name
    name = adapter_name(fields.get("lora_path"), fields.get("adapter_name"), offered)
    session.adapter, session.use = name, True
    data: dict[str, Any] = {"message": f"LoRA {name!r} loaded for this key's tasks", "lora_path": fields["lora_path"]}
    if fields.get("adapter_name"):
        data["adapter_name"] = name
    return JSONResponse(wrap(data))


@router.post("/v1/lora/unload")
async def lora_unload(request: Request, authorization: str | None = Authorization) -> JSONResponse:
    _, session = await _lora_call(request, authorization)
    had = session.adapter
    session.adapter, session.use, session.scale = None, False, 1.0
    said = f"LoRA {had!r} unloaded: this key's tasks use the base model" if had else "No LoRA was loaded"
    return JSONResponse(wrap({"message": said}))


@router.post("/v1/lora/toggle")
async def lora_toggle(request: Request, authorization: str | None = Authorization) -> JSONResponse:
    fields, session = await _lora_call(request, authorization)
    session.use = toggle_of(session, fields.get("use_lora"))
    said = "LoRA enabled for this key's tasks" if session.use else "LoRA disabled: this key's tasks use the base model"
    return JSONResponse(wrap({"message": said, "use_lora": session.use}))


@router.post("/v1/lora/scale")
async def lora_scale(request: Request, authorization: str | None = Authorization) -> JSONResponse:
    fields, session = await _lora_call(request, authorization)
    session.scale = scale_of(fields.get("scale"))
    data: dict[str, Any] = {"message": f"LoRA scale set to {session.scale:g}", "scale": session.scale}
    if fields.get("adapter_name"):
        data["adapter_name"] = fields["adapter_name"]
    return JSONResponse(wrap(data))


@router.get("/v1/lora/status")
async def lora_status(request: Request, authorization: str | None = Authorization) -> JSONResponse:
    caller = check_header(_keys(request), authorization)
    return JSONResponse(wrap(_session(request, caller).status()))


@router.get("/v1/lora/list")
async def lora_list(request: Request, authorization: str | None = Authorization) -> JSONResponse:
    caller = check_header(_keys(request), authorization)
    listed = await parts(request).adapters.listing(caller)
    return JSONResponse(wrap([{"name": a["name"], "path": a["name"]} for a in listed]))
