"""What each MCP tool does, over the same job and upload services the HTTP routes call.

A call is the HTTP API's call with the caller's key: the key's limits and quota apply, another key's
job is not found, and every refusal is the HTTP API's own sentence (``server.py`` turns it into the
tool's error). A submitted song is checked strictly (``JobService.submit``'s ``strict``): an assistant
is told a value is out of range rather than getting a song it did not ask for.
"""

from __future__ import annotations

import base64
import binascii
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from songserve.api.jobs.states import TERMINAL_JOB, JobStatus, TrackStatus
from songserve.api.service.adapters import AdapterService
from songserve.api.service.job_service import JobService
from songserve.api.service.keys import Caller
from songserve.api.service.uploads import UploadService
from songserve.errors import FieldError
from songserve.http.errors import validation_message
from songserve.schemas import GenerateRequest, JobView

log = logging.getLogger(__name__)
NESTED = re.compile(r"^Field 'continue_from\.(\w+)': (.*)\.$", re.S)  # a retake's refusal, as the HTTP API names it
Progress = Callable[[float, str], Awaitable[None]]  # percent of the job, a line saying where it is


@dataclass(frozen=True)
class Call:
    """One tool call: the services, who calls, the dispatcher's URL as the caller reaches it, the style
    catalogue, a progress sink, the fleet's adapters."""

    jobs: JobService
    uploads: UploadService
    caller: Caller | None
    base_url: str
    tags: dict[str, dict[str, Any]]
    progress: Progress
    adapters: AdapterService


def take_uri(job_id: str, index: int, kind: str = "mp3") -> str:
    return f"song://{job_id}/{index}" + ("" if kind == "mp3" else f".{kind}")


def job_answer(view: JobView, base_url: str) -> dict[str, Any]:
    """A job's view with, for each finished take, its resource and its HTTP downloads (absolute)."""
    body = view.model_dump(mode="json")
    body["takes"] = [
        {
            "index": t.index,
            "resource": take_uri(view.job_id, t.index),
            "wav_resource": take_uri(view.job_id, t.index, "wav"),
            "mp3_url": base_url + t.files.mp3,
            "wav_url": base_url + t.files.wav,
            "duration_sec": t.duration_sec,
        }
        for t in view.tracks
        if t.status == TrackStatus.done and t.files is not None
    ]
    return body


def overall(view: JobView) -> tuple[float, str]:
    """The job's percent (the mean of its takes') and one line naming each take's phase."""
    percent = sum(t.progress for t in view.tracks) / max(1, len(view.tracks))
    phases = "; ".join(f"take {t.index}: {t.phase_display}" for t in view.tracks)
    return percent, f"{view.status}: {phases}"


async def make_song(c: Call, args: Any) -> dict[str, Any]:
    req = GenerateRequest.model_validate(args.model_dump(exclude_unset=True))
    accepted = await c.jobs.submit(req, caller=c.caller, strict=True)
    return {**accepted.model_dump(mode="json"), "job_url": f"{c.base_url}/job/{accepted.job_id}"}


ORIGIN = (
    "job_id",
    "track_index",
    "at_sec",
    "end_sec",
    "before_sec",
    "parts",
)  # the tools' arguments that are continue_from's


async def retake(c: Call, args: Any) -> dict[str, Any]:
    """A retake, a repaint or an extension at the start: the tools differ only in which of ``continue_from``'s
    fields they take as their own arguments."""
    sent = args.model_dump(exclude_unset=True)
    origin = {k: sent.pop(k) for k in ORIGIN if k in sent}
    try:  # the take is named by this tool's own arguments (job_id, at_sec, ...), so a refusal names them
        req = GenerateRequest.model_validate({**sent, "continue_from": origin})
        accepted = await c.jobs.submit(req, caller=c.caller, strict=True)
    except (ValidationError, FieldError) as exc:
        said = validation_message(exc.errors()) if isinstance(exc, ValidationError) else str(exc)
        if (m := NESTED.match(said)) is None:
            raise
        raise FieldError(m[1], m[2]) from None
    return {**accepted.model_dump(mode="json"), "job_url": f"{c.base_url}/job/{accepted.job_id}"}


async def repaint(c: Call, args: Any) -> dict[str, Any]:
    """A retake that names the part to write again: ``at_sec`` and ``end_sec``, or ``parts``."""
    if args.parts is not None and (args.at_sec is not None or args.end_sec is not None):
        raise FieldError("parts", "replaces at_sec and end_sec: send one or the other")
    if args.parts is None and (args.at_sec is None or args.end_sec is None):
        missing = "end_sec" if args.at_sec is not None else "at_sec"
        raise FieldError(missing, "is required: send at_sec and end_sec, or parts")
    return await retake(c, args)


async def wait_for_job(c: Call, args: Any) -> dict[str, Any]:
    """The job's views as it changes, each new percent or phase sent as progress, up to the timeout."""
    job_id: str = args.job_id
    await c.jobs.visible(job_id, c.caller)
    said, view = None, None
    async for view in c.jobs.watch(job_id, args.timeout_sec):
        now = overall(view)
        if now != said:
            said = now
            await c.progress(*now)
    assert view is not None  # watch gives the view at least once
    answer = job_answer(view, c.base_url)
    answer["ended"] = JobStatus(view.status) in TERMINAL_JOB and all(
        TrackStatus(t.status).terminal for t in view.tracks
    )
    return answer


async def get_job(c: Call, args: Any) -> dict[str, Any]:
    job_id: str = args.job_id
    await c.jobs.visible(job_id, c.caller)
    return job_answer(await c.jobs.view(job_id), c.base_url)


async def list_jobs(c: Call, args: Any) -> dict[str, Any]:
    page = await c.jobs.jobs(c.caller, args.limit, args.cursor)
    return page.model_dump(mode="json")


async def cancel_job(c: Call, args: Any) -> dict[str, Any]:
    job_id: str = args.job_id
    await c.jobs.visible(job_id, c.caller)
    return job_answer(await c.jobs.cancel(job_id), c.base_url)


async def list_style_tags(c: Call, _: Any) -> dict[str, Any]:
    return c.tags


async def list_adapters(c: Call, _: Any) -> dict[str, Any]:
    """``GET /adapters`` as this key sees it: the fleet's own adapters and the uploads of keys it sees."""
    return {"adapters": await c.adapters.listing(c.caller)}


async def upload_audio(c: Call, args: Any) -> dict[str, Any]:
    try:
        data = base64.b64decode(args.audio_base64, validate=True)
    except (binascii.Error, ValueError):
        raise FieldError("audio_base64", "is not base64 (A–Z, a–z, 0–9, +, / and = padding)") from None
    if not data:
        raise FieldError("audio_base64", "is empty: send the audio file's bytes")
    view = await c.uploads.create(data, args.filename, c.caller)
    answer = view.model_dump(mode="json")
    answer["continue_with"] = {"upload_id": view.upload_id}
    return answer


CALLS: dict[str, Callable[[Call, Any], Awaitable[dict[str, Any]]]] = {
    "make_song": make_song,
    "wait_for_job": wait_for_job,
    "get_job": get_job,
    "list_jobs": list_jobs,
    "retake": retake,
    "repaint": repaint,
    "extend_start": retake,
    "cancel_job": cancel_job,
    "list_style_tags": list_style_tags,
    "list_adapters": list_adapters,
    "upload_audio": upload_audio,
}
