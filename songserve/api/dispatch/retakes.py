"""``continue_from``: a retake of a finished take, or the continuation of an upload, checked and resolved
before anything is queued.

Why at submit: every reason a retake cannot be served is known from the store and the results
folder (the job is gone, its track is not done or kept no codes, ``at_sec`` is outside the song, the
request asks for other models than the ones that made it), so each answers 422 naming its field
and nothing is queued that could only fail. What a worker gets later is the kept frames
themselves (``PrefixCodes``): they are cut from the original's codes now and kept in the new job's
folder, so the retake does not depend on the original staying within its retention.

What the retake does not send it inherits from the original's request: the style, lyrics,
duration, sampling settings and models, and the LoRA adapter and scale its take was made with; ``num_tracks``, ``seed``, ``priority`` (and the ACE-Step
dialect's ``acestep`` extras) are its own.

An extension at the start (``continue_from.before_sec``) is a repaint of a grid that starts with room
for the new opening (``CodeGrid.opened``): nothing kept before it, the join at or after the room, so
the song is longer by about ``before_sec`` and the original is kept exactly after the join.

A repaint (``continue_from.end_sec``) keeps the whole original grid instead of its start: the worker
writes the frames from ``at_sec`` on and rejoins the original within ``REPAINT_JOIN_WINDOW_SEC`` of
``end_sec`` (``RepaintSpan``), so the take is as long as the original and inherits its duration; a
part shorter than a frame, or an end past the song, is a 422 naming the field. A repaint of several
parts (``continue_from.parts``) is one span per part, each checked as that one is; besides, a part must
start after the part before it has rejoined, whatever join it picks (more than a join window and a frame
after its end), else it is a 422 naming that part.

An upload (``continue_from.upload_id``) has no request to inherit from: the continuation is the
request as sent, keeping the upload's frames before ``at_sec`` (all of them when it is left out).
Gone or failed: 422 before any work. Ready: its frames are cut now, as a take's. Still queued or
encoding: the job is accepted and its tracks wait in the queue; the dispatch pass cuts the frames
once the upload is ready (``upload_frames_ready``), or fails the tracks with the upload's error.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from songserve.api.jobs.records import Job
from songserve.api.jobs.states import TrackStatus
from songserve.api.results.artifacts import ArtifactStore
from songserve.api.store.uploads import UploadRecord
from songserve.api.workers.outcomes import Outcome, OutcomeKind
from songserve.audio import codes
from songserve.audio.reading import HOP, SAMPLE_RATE
from songserve.errors import FieldError, NotFoundError
from songserve.schemas import ContinueFrom, GenerateRequest, PrefixCodes, UploadStatus
from songserve.schemas.continuation import MAX_PREFIX_FRAMES, RepaintPart, RepaintSpan

log = logging.getLogger(__name__)
INHERITED = ("mode", "prompt_mode", "prompt", "tags", "lyrics", "duration", "top_k_bb", "temperature", "top_k_sr")
MODELS = ("backbone", "superres")
# A retake's own, never the original's: how many, seeds, priority, what it continues, its preview, its events' URL.
OWN = {
    "num_tracks",
    "seed",
    "priority",
    "continue_from",
    "acestep",
    "preview",
    "webhook",
    "webhook_events",
    "adapter",
    "adapter_scale",
    "takes",
}
FPS = SAMPLE_RATE / HOP  # an upload's frames per second before its codes (which say so) exist
LoadUpload = Callable[[str], Awaitable[UploadRecord | None]]


@dataclass(frozen=True)
class Retake:
    """A resolved ``continue_from``: the request as it will run, and the frames it keeps."""

    request: GenerateRequest
    kept: codes.CodeGrid | None  # (64, K), its header naming the original and where it was cut; None: an
    # upload still encoding (cut at dispatch)


def origin_of(cf: ContinueFrom) -> str:
    """The label a retake's prefix carries to the worker (its KV snapshots are reported by it)."""
    return f"upload/{cf.upload_id}" if cf.upload_id is not None else f"{cf.job_id}/{cf.track_index}"


async def resolve(
    req: GenerateRequest,
    load_job: Callable[[str], Awaitable[Job]],
    artifacts: ArtifactStore,
    load_upload: LoadUpload,
    join_window_sec: float,
) -> Retake:
    """The retake ``req`` asks for, or the ``FieldError`` that says why it cannot be served."""
    cf = req.continue_from
    assert cf is not None
    if cf.upload_id is not None:
        return await _resolve_upload(req, cf, artifacts, load_upload, join_window_sec)
    assert cf.job_id is not None
    try:
        original = await load_job(cf.job_id)
    except NotFoundError:
        raise FieldError(
            "continue_from.job_id", f"job {cf.job_id} is not known here (finished jobs are kept for RESULT_TTL_SEC)"
        ) from None
    if cf.track_index >= len(original.tracks):
        raise FieldError("continue_from.track_index", f"job {cf.job_id} has {len(original.tracks)} tracks")
    track = original.tracks[cf.track_index]
    if track.status is not TrackStatus.done:
        raise FieldError(
            "continue_from.track_index", f"track {cf.track_index} of job {cf.job_id} is {track.status.value}, not done"
        )
    grid = await asyncio.to_thread(_read_codes, artifacts, cf)
    fps = float(grid.header["frame_rate"])
    if cf.before_sec is not None:
        request = _merged(req, original.request, grid.header.get("models") or {}, cf.track_index)
        if "duration" in req.body.sent:
            raise FieldError("duration", "an extension is as long as the take and its new opening: leave duration out")
        opened = opening(grid, cf, fps, join_window_sec)
        return Retake(request.model_copy(update={"duration": opened.seconds() / 60}), opened)
    if cf.parts is not None:
        request = _merged(req, original.request, grid.header.get("models") or {}, cf.track_index)
        if "duration" in req.body.sent and request.duration != original.request.duration:
            raise FieldError("duration", "a repaint is as long as the take it repaints: leave duration out")
        return Retake(request, repainted_grid(grid, cf, fps, join_window_sec))
    assert cf.at_sec is not None
    keep = int(cf.at_sec * fps)  # frames wholly before at_sec
    if not 1 <= keep < grid.frames:
        raise FieldError(
            "continue_from.at_sec", f"must be inside the song: from {1 / fps:.3f} s to below {grid.seconds():.2f} s"
        )
    request = _merged(req, original.request, grid.header.get("models") or {}, cf.track_index)
    head = {**grid.header, "origin": origin_of(cf), "at_sec": cf.at_sec}
    if cf.end_sec is not None:
        if "duration" in req.body.sent and request.duration != original.request.duration:
            raise FieldError("duration", "a repaint is as long as the take it repaints: leave duration out")
        span = repaint_span(cf, keep, grid.frames, fps, join_window_sec)
        return Retake(request, codes.CodeGrid(grid.codes, {**head, "repaint": span.model_dump()}))
    if int(request.duration * 60 * fps) <= keep:
        raise FieldError(
            "duration",
            f"{request.duration:g} minutes end before continue_from.at_sec ({cf.at_sec:g} s); ask for a longer song",
        )
    kept = grid.cut(keep)
    return Retake(request, codes.CodeGrid(kept.codes, {**head, "frames": kept.frames}))


def opening(grid: codes.CodeGrid, cf: ContinueFrom, fps: float, join_window_sec: float) -> codes.CodeGrid:
    """The grid an extension at the start is written into: room for ``before_sec`` of new opening, then
    the original; its header names the span (``RepaintSpan.opening``) and where it came from."""
    assert cf.before_sec is not None
    room = opening_room(cf.before_sec, grid.frames, fps)
    span = RepaintSpan(start=0, end=room, window=round(join_window_sec * fps), opening=room)
    opened = grid.opened(room)
    head = {**opened.header, "origin": origin_of(cf), "before_sec": cf.before_sec, "repaint": span.model_dump()}
    return codes.CodeGrid(opened.codes, head)


def opening_room(before_sec: float, frames: int, fps: float) -> int:
    """The frames of a new opening of ``before_sec`` before a ``frames``-frame song, or a 422 where it is
    shorter than a frame or makes the song longer than a worker makes one."""
    room = round(before_sec * fps)
    if room < 1:
        raise FieldError("continue_from.before_sec", f"is shorter than a frame ({1 / fps * 1000:.0f} ms)")
    if room + frames > MAX_PREFIX_FRAMES:
        raise FieldError(
            "continue_from.before_sec",
            f"makes the song longer than {MAX_PREFIX_FRAMES / fps / 60:.0f} minutes, the longest a worker makes",
        )
    return room


def repaint_span(cf: ContinueFrom, start: int, frames: int, fps: float, join_window_sec: float) -> RepaintSpan:
    """The frames a repaint writes anew: from ``start`` (frames wholly before ``at_sec``) to the frame
    of ``end_sec``, the join searched within the window around it; a 422 where that is no part of the song."""
    assert cf.end_sec is not None
    end = span_end(cf.end_sec, start, frames, fps, "continue_from")
    return RepaintSpan(start=start, end=end, window=round(join_window_sec * fps))


def span_end(end_sec: float, start: int, frames: int, fps: float, field: str, index: int | None = None) -> int:
    """The frame a part ending at ``end_sec`` ends at (``field``'s ``end_sec``), or a 422 where it is past the
    song or less than a frame after the part's ``start``."""
    end = round(end_sec * fps)
    if end > frames:
        raise FieldError(
            f"{field}.end_sec",
            f"is past the end of the song ({frames / fps:.2f} s): a repaint ends inside it",
            index=index,
        )
    if end <= start:
        raise FieldError(
            f"{field}.end_sec",
            f"the part from {field}.at_sec to here is shorter than a frame ({1 / fps * 1000:.0f} ms)",
            index=index,
        )
    return end


def repaint_parts(parts: list[RepaintPart], frames: int, fps: float, join_window_sec: float) -> list[RepaintSpan]:
    """A repaint's parts as spans, in order, or a 422 naming the part (``continue_from.parts.<i>``) where one
    is no part of the song or would not rejoin the original before the next one starts."""
    window = round(join_window_sec * fps)
    spans: list[RepaintSpan] = []
    for i, part in enumerate(parts):
        name = f"continue_from.parts.{i}"
        start = int(part.at_sec * fps)  # frames wholly before at_sec are kept
        if not 1 <= start < frames:
            raise FieldError(
                f"{name}.at_sec",
                f"must be inside the song: from {1 / fps:.3f} s to below {frames / fps:.2f} s",
                index=i,
            )
        end = span_end(part.end_sec, start, frames, fps, name, index=i)
        if spans:
            before = spans[-1]
            if start < before.start:
                raise FieldError(name, f"starts before part {i - 1}: send the parts in order of their start", index=i)
            if start < before.end:
                raise FieldError(name, f"overlaps part {i - 1}, which ends at {before.end / fps:.2f} s", index=i)
            if start <= before.end + window:
                raise FieldError(
                    name,
                    f"starts {(start - before.end) / fps:.2f} s after part {i - 1} ends; part {i - 1} may rejoin "
                    f"the original up to {join_window_sec:g} s after its end (REPAINT_JOIN_WINDOW_SEC), so the "
                    f"next part starts more than that and a frame after it",
                    index=i,
                )
        spans.append(RepaintSpan(start=start, end=end, window=window))
    return spans


def repainted_grid(grid: codes.CodeGrid, cf: ContinueFrom, fps: float, join_window_sec: float) -> codes.CodeGrid:
    """The whole grid of a repaint of several parts, its header naming them (``parts``, the first also as
    ``repaint``, as a single repaint's is named) and where it came from."""
    assert cf.parts is not None
    spans = repaint_parts(cf.parts, grid.frames, fps, join_window_sec)
    head = {
        **grid.header,
        "origin": origin_of(cf),
        "at_sec": cf.parts[0].at_sec,
        "repaint": spans[0].model_dump(),
        "parts": [s.model_dump() for s in spans],
    }
    return codes.CodeGrid(grid.codes, head)


async def _resolve_upload(
    req: GenerateRequest, cf: ContinueFrom, artifacts: ArtifactStore, load_upload: LoadUpload, join_window_sec: float
) -> Retake:
    assert cf.upload_id is not None
    u = await load_upload(cf.upload_id)
    if u is None:
        raise FieldError(
            "continue_from.upload_id", f"upload {cf.upload_id} is not known here (uploads are kept for RESULT_TTL_SEC)"
        )
    if u.status is UploadStatus.failed:
        raise FieldError("continue_from.upload_id", f"upload {cf.upload_id} could not be encoded: {u.error}")
    if cf.at_sec is not None and not 1 / FPS <= cf.at_sec <= u.duration_sec + 1e-6:
        raise FieldError(
            "continue_from.at_sec",
            f"must be inside the upload: from {1 / FPS:.3f} s to {u.duration_sec:.2f} s (or left out: its end)",
        )
    keep = upload_keep(cf, u.frames, FPS)
    if cf.before_sec is not None:
        if "duration" in req.body.sent:
            raise FieldError(
                "duration", "an extension is as long as the upload and its new opening: leave duration out"
            )
        room = opening_room(cf.before_sec, u.frames, FPS)
        req = req.model_copy(update={"duration": (room + u.frames) / FPS / 60})
    elif cf.parts is not None:
        repaint_parts(cf.parts, u.frames, FPS, join_window_sec)  # every part must be inside the upload
        if "duration" in req.body.sent:
            raise FieldError("duration", "a repaint is as long as the upload it repaints: leave duration out")
        req = req.model_copy(update={"duration": u.frames / FPS / 60})
    elif cf.end_sec is not None:
        repaint_span(cf, keep, u.frames, FPS, join_window_sec)  # the part must be inside the upload
        if "duration" in req.body.sent:
            raise FieldError("duration", "a repaint is as long as the upload it repaints: leave duration out")
        req = req.model_copy(update={"duration": u.frames / FPS / 60})
    elif int(req.duration * 60 * FPS) <= keep:
        raise FieldError(
            "duration",
            f"{req.duration:g} minutes end before the upload's kept part ({keep / FPS:.2f} s); ask for a longer song",
        )
    if u.status is not UploadStatus.ready:
        return Retake(req, None)  # its tracks wait for the encoding (upload_frames_ready)
    try:
        return Retake(req, await asyncio.to_thread(upload_prefix, artifacts, cf, join_window_sec))
    except (OSError, codes.CodesFileError) as exc:
        log.error("upload %s: codes file unreadable: %s", cf.upload_id, exc)
        raise FieldError("continue_from.upload_id", f"the codes of upload {cf.upload_id} cannot be read") from None


def upload_keep(cf: ContinueFrom, frames: int, fps: float) -> int:
    """Frames of an upload a continuation keeps: those wholly before ``at_sec``, or all of them."""
    return frames if cf.at_sec is None else min(frames, int(cf.at_sec * fps))


def upload_prefix(artifacts: ArtifactStore, cf: ContinueFrom, join_window_sec: float) -> codes.CodeGrid:
    """A ready upload's kept frames (for a repaint, all of them and the part written anew), labelled as a
    retake's are (``OSError`` / ``CodesFileError`` if unreadable)."""
    assert cf.upload_id is not None
    grid = codes.read(artifacts.upload_path(cf.upload_id, "codes.codes"))
    fps = float(grid.header["frame_rate"])
    if cf.before_sec is not None:
        return opening(grid, cf, fps, join_window_sec)
    if cf.parts is not None:
        return repainted_grid(grid, cf, fps, join_window_sec)
    if cf.end_sec is not None:
        span = repaint_span(cf, upload_keep(cf, grid.frames, fps), grid.frames, fps, join_window_sec)
        head = {**grid.header, "origin": origin_of(cf), "at_sec": cf.at_sec, "repaint": span.model_dump()}
        return codes.CodeGrid(grid.codes, head)
    kept = grid.cut(upload_keep(cf, grid.frames, fps))
    return codes.CodeGrid(kept.codes, {**kept.header, "origin": origin_of(cf), "at_sec": kept.frames / fps})


async def upload_frames_ready(
    job: Job, artifacts: ArtifactStore, load_upload: LoadUpload, join_window_sec: float
) -> bool | str:
    """A job continuing an upload, at dispatch: True once its kept frames are in its folder (cut now if
    the upload has become ready), False while the upload is queued or encoding, else why they never will be."""
    cf = job.request.continue_from
    assert cf is not None
    assert cf.upload_id is not None
    if artifacts.prefix_path(job.job_id).is_file():
        return True
    u = await load_upload(cf.upload_id)
    if u is None:
        return f"its upload {cf.upload_id} is gone"
    if u.status is UploadStatus.failed:
        return f"its upload {cf.upload_id} could not be encoded: {u.error}"
    if u.status is not UploadStatus.ready:
        return False
    try:
        grid = await asyncio.to_thread(upload_prefix, artifacts, cf, join_window_sec)
        await asyncio.to_thread(artifacts.write_prefix, job.job_id, codes.encode(grid.codes, grid.header))
    except (OSError, codes.CodesFileError) as exc:
        log.error("job %s: the kept frames of upload %s cannot be cut (%s)", job.job_id, cf.upload_id, exc)
        return f"the codes of its upload {cf.upload_id} cannot be read"
    except FieldError as exc:  # its encoding came out shorter than the part to repaint
        return f"upload {cf.upload_id}: {exc}"
    log.info("job %s: upload %s is ready, %d frames kept", job.job_id, cf.upload_id, grid.frames)
    return True


def _read_codes(artifacts: ArtifactStore, cf: ContinueFrom) -> codes.CodeGrid:
    assert cf.job_id is not None
    if not artifacts.has(cf.job_id, cf.track_index, "codes"):
        raise FieldError(
            "continue_from.track_index",
            f"track {cf.track_index} of job {cf.job_id} kept no codes "
            "(its worker writes none, or it was made before codes were kept)",
        )
    try:
        return codes.read(artifacts.path(cf.job_id, cf.track_index, "codes"))
    except (OSError, codes.CodesFileError) as exc:
        log.error("job %s track %d: codes file unreadable: %s", cf.job_id, cf.track_index, exc)
        raise FieldError(
            "continue_from.track_index", f"the codes of track {cf.track_index} of job {cf.job_id} cannot be read"
        ) from None


def _merged(req: GenerateRequest, original: GenerateRequest, made_by: dict[str, Any], index: int) -> GenerateRequest:
    """The retake's body: what it sent, else the original's values (the adapter: take ``index``'s); the
    models must be the ones that made it."""
    sent = req.body.sent
    body: dict[str, Any] = {k: getattr(original, k) for k in INHERITED}
    if req.adapter is None and req.takes is None and "adapter_scale" not in sent:
        adapter, scale = original.take_adapter(index)
        body |= {"adapter": adapter or None, "adapter_scale": scale}
    body.update({k: v for k, v in sent.items() if k in INHERITED})
    for name in MODELS:
        want, made = sent.get(name) or getattr(original, name), made_by.get(name)
        if made and want and want != made:
            raise FieldError(name, f"must be {made!r}, the model that made the take being continued")
        body[name] = made or want
    own = req.model_dump(include=OWN, exclude_unset=True)
    merged = GenerateRequest.model_validate({**body, **own})
    merged._body = req.body  # what the client sent (and its unknown names) is what the answer reports on
    return merged


def describe(grid: codes.CodeGrid) -> str:
    """What a resolved ``continue_from`` does, for the log: a retake, a repaint or an extension."""
    head = grid.header
    span = head.get("repaint")
    fps = float(head["frame_rate"])
    if isinstance(span, dict) and span.get("opening"):
        return f"extends {head['origin']} by a {span['opening'] / fps:.2f} s opening ({grid.frames} frames)"
    parts = head.get("parts")
    if isinstance(parts, list):
        where = ", ".join(f"{p['start'] / fps:.2f}-{p['end'] / fps:.2f} s" for p in parts)
        return f"repaints {head['origin']} in {len(parts)} parts: {where}"
    if isinstance(span, dict):
        return f"repaints {head['origin']} from {span['start'] / fps:.2f} s to {span['end'] / fps:.2f} s"
    return f"continues {head['origin']} from {head['at_sec']:.2f} s ({grid.frames} frames kept)"


def prefix_codes(grid: codes.CodeGrid) -> PrefixCodes:
    """The kept frames as a worker receives them (a repaint's whole grid with its span, or its parts)."""
    span, several = grid.header.get("repaint"), grid.header.get("parts")
    parts = None
    if isinstance(several, list):
        parts = [RepaintSpan.model_validate(p) for p in several]
    elif isinstance(span, dict):
        parts = [RepaintSpan.model_validate(span)]
    return PrefixCodes.of(grid.raw(), grid.levels, grid.frames, str(grid.header.get("origin", "")), parts)


async def kept_frames(artifacts: ArtifactStore, job: Job) -> PrefixCodes | None:
    """A retake's kept frames, cut when it was submitted; None when they are gone from its folder."""
    try:
        grid = await asyncio.to_thread(codes.read, artifacts.prefix_path(job.job_id))
    except (OSError, codes.CodesFileError) as exc:
        log.error("job %s: its kept frames cannot be read (%s)", job.job_id, exc)
        return None
    return prefix_codes(grid)


def frames_gone(takes: int, why: str = "") -> Callable[[], Awaitable[list[Outcome]]]:
    """The outcome of an attempt whose kept frames are gone: each take fails, saying so (and ``why``)."""
    said = (
        f"The kept frames are missing: {why}." if why else "The retake's kept frames are gone from the results folder."
    )

    async def gone() -> list[Outcome]:
        return [Outcome(OutcomeKind.error, error=said)] * takes

    return gone
