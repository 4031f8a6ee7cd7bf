"""``continue_from``: a retake of a finished take, checked and resolved before anything is queued.

Why at submit: every reason a retake cannot be served is known from the store and the results
folder (the job is gone, its track is not done or kept no codes, ``at_sec`` is outside the song, the
request asks for other models than the ones that made it), so each answers 422 naming its field
and nothing is queued that could only fail. What a worker gets later is the kept frames
themselves (``PrefixCodes``): they are cut from the original's codes now and kept in the new job's
folder, so the retake does not depend on the original staying within its retention.

What the retake does not send it inherits from the original's request: the style, lyrics,
duration, sampling settings and models; ``num_tracks``, ``seed``, ``priority`` (and the ACE-Step
dialect's ``acestep`` extras) are its own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from songserve import codes
from songserve.api.artifacts import ArtifactStore
from songserve.api.outcomes import Outcome, OutcomeKind
from songserve.api.states import TrackStatus
from songserve.api.store import Job
from songserve.errors import FieldError, NotFoundError
from songserve.schemas import ContinueFrom, GenerateRequest, PrefixCodes

log = logging.getLogger(__name__)
INHERITED = ("mode", "prompt_mode", "prompt", "tags", "lyrics", "duration", "top_k_bb", "temperature", "top_k_sr")
MODELS = ("backbone", "superres")
# A retake's own, never the original's: how many, seeds, priority, what it continues, its preview, its events' URL.
OWN = {"num_tracks", "seed", "priority", "continue_from", "acestep", "preview", "webhook", "webhook_events"}


@dataclass(frozen=True)
class Retake:
    """A resolved ``continue_from``: the request as it will run, and the frames it keeps."""

    request: GenerateRequest
    kept: codes.CodeGrid  # (64, K), its header naming the original and where it was cut


def origin_of(cf: ContinueFrom) -> str:
    """The label a retake's prefix carries to the worker (its KV snapshots are reported by it)."""
    return f"{cf.job_id}/{cf.track_index}"


async def resolve(req: GenerateRequest, load_job: Callable[[str], Awaitable[Job]], artifacts: ArtifactStore) -> Retake:
    """The retake ``req`` asks for, or the ``FieldError`` that says why it cannot be served."""
    cf = req.continue_from
    assert cf is not None
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
        raise FieldError("continue_from.track_index", f"track {cf.track_index} of job {cf.job_id} is "
                         f"{track.status.value}, not done")  # fmt: skip
    grid = await asyncio.to_thread(_read_codes, artifacts, cf)
    fps = float(grid.header["frame_rate"])
    keep = int(cf.at_sec * fps)  # frames wholly before at_sec
    if not 1 <= keep < grid.frames:
        raise FieldError("continue_from.at_sec", f"must be inside the song: from {1 / fps:.3f} s to below "
                         f"{grid.seconds():.2f} s")  # fmt: skip
    request = _merged(req, original.request, grid.header.get("models") or {})
    if int(request.duration * 60 * fps) <= keep:
        raise FieldError("duration", f"{request.duration:g} minutes end before continue_from.at_sec "
                         f"({cf.at_sec:g} s); ask for a longer song")  # fmt: skip
    head = {**grid.header, "origin": origin_of(cf), "at_sec": cf.at_sec}
    kept = grid.cut(keep)
    return Retake(request, codes.CodeGrid(kept.codes, {**head, "frames": kept.frames}))


def _read_codes(artifacts: ArtifactStore, cf: ContinueFrom) -> codes.CodeGrid:
    if not artifacts.has(cf.job_id, cf.track_index, "codes"):
        raise FieldError("continue_from.track_index", f"track {cf.track_index} of job {cf.job_id} kept no codes "
                         "(its worker writes none, or it was made before codes were kept)")  # fmt: skip
    try:
        return codes.read(artifacts.path(cf.job_id, cf.track_index, "codes"))
    except (OSError, codes.CodesFileError) as exc:
        log.error("job %s track %d: codes file unreadable: %s", cf.job_id, cf.track_index, exc)
        raise FieldError("continue_from.track_index", f"the codes of track {cf.track_index} of job {cf.job_id} "
                         "cannot be read") from None  # fmt: skip


def _merged(req: GenerateRequest, original: GenerateRequest, made_by: dict[str, Any]) -> GenerateRequest:
    """The retake's body: what it sent, else the original's values; the models must be the ones that made it."""
    sent = req.body.sent
    body: dict[str, Any] = {k: getattr(original, k) for k in INHERITED}
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


def prefix_codes(grid: codes.CodeGrid) -> PrefixCodes:
    """The kept frames as a worker receives them."""
    return PrefixCodes.of(grid.raw(), grid.levels, grid.frames, str(grid.header.get("origin", "")))


async def kept_frames(artifacts: ArtifactStore, job: Job) -> PrefixCodes | None:
    """A retake's kept frames, cut when it was submitted; None when they are gone from its folder."""
    try:
        grid = await asyncio.to_thread(codes.read, artifacts.prefix_path(job.job_id))
    except (OSError, codes.CodesFileError) as exc:
        log.error("job %s: its kept frames cannot be read (%s)", job.job_id, exc)
        return None
    return prefix_codes(grid)


def frames_gone(takes: int) -> Callable[[], Awaitable[list[Outcome]]]:
    """The outcome of an attempt whose kept frames are gone: each take fails, saying so."""

    async def gone() -> list[Outcome]:
        return [Outcome(OutcomeKind.error, error="The retake's kept frames are gone from the results folder.")] * takes

    return gone
