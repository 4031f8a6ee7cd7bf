"""ACE-Step tasks through the same ``JobService`` as our own routes: a task is a job.

``submit`` hands the translated request to ``JobService.submit`` (the same normalisation, limits,
queue and store) and says its refusals in ACE-Step's names (``duration`` → ``audio_duration``, or the
alias the client used) with ACE-Step's 400; ``find`` reads a job and its view (from memory while
active, else from the store, so any dispatcher of a shared store answers); ``continue_from`` is
where a repaint goes.
"""

from __future__ import annotations

import logging
from typing import Any

from songserve.api.acestep.bodies import Upload
from songserve.api.acestep.failures import AceError, field_error
from songserve.api.acestep.files import AudioRef
from songserve.api.acestep.translate import ACE_NAMES, Repaint, Task
from songserve.api.artifacts import JOB_ID
from songserve.api.service import JobService
from songserve.api.store import Job
from songserve.api.views import job_view
from songserve.errors import FieldError
from songserve.schemas import GenerateAccepted, JobView

log = logging.getLogger(__name__)


def _ace_name(task: Task, ours: str) -> str:
    return task.keys.get(ours, ACE_NAMES.get(ours, ours))


async def submit(svc: JobService, task: Task) -> GenerateAccepted:
    try:
        accepted = await svc.submit(task.request)
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


async def find(svc: JobService, task_id: str) -> tuple[Job, JobView] | None:
    """The job of a task id and its view, or None for an id no job has."""
    job = svc.dispatcher.active_job(task_id)
    if job is None and JOB_ID.match(task_id):
        job = await svc.store.load_job(task_id)
    if job is None:
        return None
    facts = svc.dispatcher.facts(job)
    return job, job_view(job, facts.positions, facts.eta)


async def source_take(svc: JobService, ref: AudioRef, key: str) -> float:
    """The seconds of the finished take a ``src_audio_path`` names, or a 400 naming the key."""
    found = await find(svc, ref.job_id)
    tracks = found[1].tracks if found else []
    take = tracks[ref.index] if ref.index < len(tracks) else None
    if take is None or take.status != "done":
        raise field_error(key, "names no finished take of this server")
    return take.duration_sec


async def continue_from(svc: JobService, repaint: Repaint) -> dict[str, Any]:
    """A repaint to the end: continue the source from ``start`` (the retake of a point).

    Everything about the request is checked by now; what is left is the continuation itself, which
    needs ``continue_from`` on ``POST /generate`` (and, for an upload, audio uploads).
    """
    key = repaint.task.keys.get("src_audio_path", "src_audio_path")
    if isinstance(repaint.source, AudioRef):
        seconds = await source_take(svc, repaint.source, key)
        if repaint.start > seconds:
            raise field_error("repainting_start", f"is past the end of the source ({seconds:.2f} s)")
    what = "an uploaded src_audio" if isinstance(repaint.source, Upload) else "a take"
    raise AceError(400, f"Field 'task_type': repaint of {what} needs continue_from, not available in this build.")
