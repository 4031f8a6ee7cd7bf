"""ACE-Step tasks through the same ``JobService`` as our own routes: a task is a job.

``submit`` hands the translated request to ``JobService.submit`` (the same normalisation, limits,
queue and store) and says its refusals in ACE-Step's names (``duration`` → ``audio_duration``, or the
alias the client used) with ACE-Step's 400; ``find`` reads a job and its view (from memory while
active, else from the store, so any dispatcher of a shared store answers); ``continue_from`` makes
a repaint to the end our retake of a point (``continue_from`` on ``POST /generate``): the source take
(a ``src_audio_path`` this server returned names its job and take) kept up to ``repainting_start``,
the rest generated. What the repaint's body sets (caption, lyrics, length, seed, model) applies; what
it leaves out is the source take's, as for any retake (``songserve/api/dispatch/retakes.py``). An uploaded
source (multipart ``src_audio``) becomes one of our uploads (``POST /uploads``: checked, stored,
encoded by a worker) and the repaint a continuation of it (``continue_from.upload_id``), which waits
in the queue while the upload encodes; a refused file is a 400 naming the key, storing nothing.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import ValidationError

from songserve.api.acestep.answers import caption_of
from songserve.api.acestep.bodies import Upload
from songserve.api.acestep.failures import AceError, field_error
from songserve.api.acestep.files import AudioRef
from songserve.api.acestep.translate import ACE_NAMES, Repaint, Task
from songserve.api.jobs.records import Job
from songserve.api.service.job_service import JobService
from songserve.api.service.keys import Caller
from songserve.api.service.uploads import UploadService, UploadTooLarge
from songserve.errors import FieldError, NotFoundError
from songserve.http.errors import clean_msg
from songserve.schemas import GenerateAccepted, GenerateRequest, JobView, TrackView

log = logging.getLogger(__name__)


def _ace_name(task: Task, ours: str) -> str:
    return task.keys.get(ours, ACE_NAMES.get(ours, ours))


async def submit(svc: JobService, task: Task, caller: Caller | None = None) -> GenerateAccepted:
    """The task as our job, under ``caller``'s key (its limits: a 429 in the wrapper when over one)."""
    try:
        accepted = await svc.submit(task.request, caller=caller)
    except FieldError as exc:
        detail = (exc.detail or [{}])[0]
        loc = detail.get("loc") or ["body"]
        ours = str(loc[-1]) if isinstance(loc, list) else "body"
        raise field_error(_ace_name(task, ours), str(detail.get("msg", exc))) from None
    for name, change in accepted.adjusted.items():
        if name == "duration":  # minutes on our side, seconds on ACE-Step's
            change = {k: round(float(v) * 60, 3) for k, v in change.items()}
        task.adjusted[_ace_name(task, name)] = change
    log.info(
        "acestep: task %s: %d takes, %s, %s prompt%s",
        accepted.job_id,
        accepted.num_tracks,
        task.audio_format,
        task.prompt_mode,
        f", ignored {', '.join(task.ignored)}" if task.ignored else "",
    )
    return accepted


async def find(svc: JobService, task_id: str, caller: Caller | None = None) -> tuple[Job, JobView] | None:
    """The job of a task id and its view, or None for an id no job has (or one another key made)."""
    try:
        job = await svc.visible(task_id, caller)
    except NotFoundError:
        return None
    return job, svc.view_of(job)


async def _source(svc: JobService, ref: AudioRef, key: str, caller: Caller | None) -> tuple[Job, TrackView]:
    """The job and the finished take a ``src_audio_path`` names, or a 400 naming the key."""
    found = await find(svc, ref.job_id, caller)
    tracks = found[1].tracks if found else []
    take = tracks[ref.index] if ref.index < len(tracks) else None
    if found is None or take is None or take.status != "done":
        raise field_error(key, "names no finished take of this server")
    return found[0], take


async def source_take(svc: JobService, ref: AudioRef, key: str, caller: Caller | None = None) -> float:
    """The seconds of the finished take a ``src_audio_path`` names, or a 400 naming the key."""
    return (await _source(svc, ref, key, caller))[1].duration_sec


async def continue_from(
    svc: JobService, uploads: UploadService, repaint: Repaint, caller: Caller | None = None
) -> Task:
    """A repaint as the task to submit: our ``continue_from`` of the source from ``start``, with
    ``end_sec`` where the end is inside the source (a bounded repaint), a longer duration where it is
    past it (an extension at the end), and neither for "to the end" (a retake).

    Everything about the request is checked by now but the source itself; an uploaded source is
    stored and queued for encoding first (``UploadService.create``), and ``task.upload_id`` names it,
    so the caller removes it if the task is refused after all.
    """
    task = repaint.task
    start_key = task.keys.get("at_sec", "repainting_start")
    if repaint.start == 0:
        raise field_error(
            start_key,
            "must not be 0: a repaint keeps the source before it, a negative start adds an opening "
            "(text2music makes a new song)",
        )
    if isinstance(repaint.source, Upload):
        return await _from_upload(uploads, task, repaint, start_key, caller)
    key = task.keys.get("src_audio_path", "src_audio_path")
    source, take = await _source(svc, repaint.source, key, caller)
    if repaint.start > take.duration_sec:
        raise field_error(start_key, f"is past the end of the source ({take.duration_sec:.2f} s)")
    cf = {"job_id": repaint.source.job_id, "track_index": repaint.source.index, **_point(repaint.start)}
    task.request = _retake(task, *_bounded(cf, repaint.end, take.duration_sec), caption_of(source), key)
    # Our retake's fields under the names the client sent: where the source and the point came from.
    task.keys |= {"continue_from": key, "job_id": key, "track_index": key, "at_sec": start_key}
    task.keys |= {"before_sec": start_key}
    return task


def _point(start: float) -> dict[str, float]:
    """``repainting_start`` as our ``continue_from``: the second a retake or repaint starts at, or (negative)
    the length of a new opening."""
    return {"before_sec": -start} if start < 0 else {"at_sec": start}


def _bounded(cf: dict[str, Any], end: float | None, seconds: float) -> tuple[dict[str, Any], float | None]:
    """(``continue_from``, a duration in minutes or None) for a repaint ending at ``end`` of a source
    ``seconds`` long: ``end_sec`` inside it; past it, a retake whose song runs on to ``end``."""
    if end is None:
        return cf, None
    if end < seconds:
        return {**cf, "end_sec": end}, None
    return cf, end / 60


async def _from_upload(
    uploads: UploadService, task: Task, repaint: Repaint, start_key: str, caller: Caller | None
) -> Task:
    """A repaint of an uploaded file: our upload of it (``caller``'s), repainted or continued from ``start``."""
    upload, start = repaint.source, repaint.start
    assert isinstance(upload, Upload)
    try:
        view = await uploads.create(upload.file, upload.filename, caller)
    except FieldError as exc:
        raise field_error(upload.field, str((exc.detail or [{}])[0].get("msg", exc))) from None
    except UploadTooLarge as exc:
        raise AceError(413, str(exc)) from None
    task.upload_id = view.upload_id
    if start > view.duration_sec:
        await uploads.delete(view.upload_id)
        raise field_error(start_key, f"is past the end of the source ({view.duration_sec:.2f} s)")
    caption = task.request.acestep.caption if task.request.acestep is not None else ""
    cf, duration = _bounded({"upload_id": view.upload_id, **_point(start)}, repaint.end, view.duration_sec)
    task.request = _retake(task, cf, duration, caption, upload.field)
    task.keys |= {"continue_from": upload.field, "upload_id": upload.field, "at_sec": start_key}
    task.keys |= {"before_sec": start_key}
    log.info("acestep: repaint of an uploaded %s from %.2f s: upload %s", upload.field, start, view.upload_id)
    return task


def _retake(task: Task, cf: dict[str, Any], duration: float | None, caption: str, key: str) -> GenerateRequest:
    """Our request for the repaint: only what its body sent, and ``continue_from``; the rest is inherited
    (from a take; an upload has nothing to inherit: the defaults apply)."""
    r, sent = task.request, task.request.body.sent
    body: dict[str, Any] = {"num_tracks": r.num_tracks, "continue_from": cf}
    if "tags" in task.keys:  # a caption (or prompt) was sent
        body |= {"prompt_mode": r.prompt_mode, "tags": r.tags, "prompt": r.prompt}
        caption = r.acestep.caption if r.acestep is not None else caption
    if "lyrics" in task.keys:
        body |= {"mode": r.mode, "lyrics": r.lyrics}
    body |= {k: sent[k] for k in ("seed", "backbone") if k in sent}
    if duration is not None:  # an extension at the end: the song runs on to the repaint's end
        body["duration"] = duration
    elif "duration" in sent and "end_sec" not in cf and "before_sec" not in cf:  # a repaint keeps its length
        body["duration"] = sent["duration"]
    body["acestep"] = {"audio_format": task.audio_format, "caption": caption}
    try:
        return GenerateRequest.model_validate(body)
    except ValidationError as exc:  # a take index past our limit
        raise field_error(key, clean_msg(exc.errors()[0]["msg"]).rstrip(".")) from None
