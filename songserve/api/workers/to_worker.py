"""The one translation at the dispatcher↔worker boundary: a job's track into what a worker receives, a
worker's answer into an ``Outcome``.

Nothing else on the dispatcher's side renames a field for a worker or reads a worker's answer: the
worker client (``workers/client.py``) sends the bodies built here and hands back what is read here.

Two dialects, picked from the worker's ``/health`` (``WorkerHealth.kind``):
- ours (``songserve``): ``WorkerGenerateRequest`` as docs/api.md has it ("Worker payload"),
  one take per ``/generate``, or several takes of one request as one ``/generate_batch``;
- the reference backend's worker: its own ``GenerateRequest`` (``reference_request``). Its errors
  carry a whole traceback: the last line is kept as the sentence.

A client's request and a worker's payload name things differently; each rename below says which
reader needs it.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import ValidationError

from songserve.api.jobs.records import Job, Track
from songserve.api.workers.outcomes import (
    AdapterRefused,
    EncodeRefused,
    Outcome,
    OutcomeKind,
    WorkerBusy,
    WorkerFault,
)
from songserve.http.errors import clean_msg
from songserve.schemas import (
    PrefixCodes,
    TaskState,
    TaskView,
    WorkerEncodeResult,
    WorkerGenerateRequest,
    WorkerGenerateResult,
)

REFERENCE_SUPERRES_TEXT_MODE = "same_as_backbone_no_description"  # what the reference dispatcher sends
# What a track's view keeps of its worker's metadata; the batch keys only when the worker sent them
# (a reference worker runs each take alone and sends none of them; "live" only where someone listened).
METADATA_KEYS = ("models", "tokens", "timings", "sample_rate", "device")
BATCH_KEYS = ("batch_size", "parked", "prefill", "continued", "repainted", "adapter", "live")


# ---- what a worker receives -----------------------------------------------------------------------
def worker_request(job: Job, t: Track, prefix: PrefixCodes | None = None) -> WorkerGenerateRequest:
    """Our worker's payload for one attempt of one track (docs/api.md, "Worker payload"); ``prefix``:
    a retake's kept frames (``retakes.py`` cut them when the job was submitted)."""
    r = job.request
    natural = r.prompt_mode == "natural"
    style = r.prompt if natural else r.tags
    adapter, scale = r.take_adapter(t.index)
    return WorkerGenerateRequest(
        # The prompt builder (ours and the reference's) reads a tags prompt from ``tags`` and a
        # natural-language one from ``description``; the client sends either as ``prompt``/``tags``.
        tags="" if natural else r.tags,
        description=r.prompt if natural else "",
        duration=r.duration,
        lyrics=job.cleaned_lyrics,
        backbone_name=r.backbone or "",
        superres_name=r.superres or "",
        top_k_bb=r.top_k_bb,
        top_k_sr=r.top_k_sr,
        temperature=r.temperature,
        # The client's words as it sent them, under the reference worker's ``raw_*`` names: a
        # worker keeps them with the track, and ours reads instrumental from ``raw_mode``.
        raw_user_input=style,
        raw_mode=r.mode,
        raw_prompt_mode=r.prompt_mode,
        # The track's seed (job seed + take index) as the worker reads it: ``seed_override`` (0 or
        # none: the worker's own seed, as the reference's).
        seed_override=t.seed,
        # Our extensions: the worker names the task, its files and its log lines by them.
        task_id=t.task_id or "",
        job_id=job.job_id,
        track_index=t.index,
        prefix=prefix,
        preview=r.preview,
        adapter=adapter,
        adapter_scale=scale,
    )


def reference_request(req: WorkerGenerateRequest) -> dict[str, Any]:
    """Our payload as the reference worker reads it (its ``GenerateRequest``)."""
    # It knows instrumental only as ``language: "Instrumental"`` (it ignores ``raw_mode``), and then
    # expects no lyrics.
    instrumental = req.raw_mode == "instrumental"
    return {
        **req.model_dump(exclude={"task_id", "job_id", "track_index", "prefix", "preview"}),  # it has no task ids
        "language": "Instrumental" if instrumental else "",
        "lyrics": "" if instrumental else req.lyrics,
        "duration": max(1, math.ceil(req.duration - 1e-9)),  # it takes whole minutes only (an int field)
        "superres_text_mode": REFERENCE_SUPERRES_TEXT_MODE,
    }


def generate_body(req: WorkerGenerateRequest, reference: bool) -> dict[str, Any]:
    """The body of ``POST /generate`` in the worker's dialect."""
    return reference_request(req) if reference else our_request(req)


def batch_body(reqs: list[WorkerGenerateRequest]) -> dict[str, Any]:
    """The body of ``POST /generate_batch`` (ours only: a reference worker runs one take at a time)."""
    return {"takes": [our_request(r) for r in reqs]}


def our_request(req: WorkerGenerateRequest) -> dict[str, Any]:
    """Our payload as our worker reads it; a prefix's ``parts`` only where a repaint has several (one part is
    ``repaint`` alone, the body every worker of ours has read)."""
    several = req.prefix is not None and req.prefix.parts is not None
    return req.model_dump(exclude=None if several else {"prefix": {"parts"}})


# ---- what a worker answers ------------------------------------------------------------------------
def read_answer(code: int, body: dict[str, Any], reference: bool) -> Outcome:
    """A ``/generate`` answer (HTTP status, JSON object) as an ``Outcome``; ``WorkerFault`` when it is none.

    ``status: "ok"`` is done: the reference's word, which our ``/generate`` keeps for its dispatcher.
    An error needs an error status (``status: "error"``, which the reference sends with HTTP 200,
    or HTTP 4xx; a 5xx only with an ``error`` sentence): a 2xx that is neither a result, busy,
    cancelled nor an error, or a 5xx with nothing to say, is the worker's fault, not the track's.
    """
    status = body.get("status")
    if status == "ok":
        try:
            return Outcome(OutcomeKind.done, result=WorkerGenerateResult.model_validate(body))
        except ValidationError as exc:
            raise WorkerFault(f"Worker result is not the contract: {_first_error(exc)}.") from None
    if status == "cancelled":
        return Outcome(OutcomeKind.cancelled)
    if status == "busy" or code == 409:
        return Outcome(OutcomeKind.busy)
    if code == 503:  # draining: it takes no new task, another worker will
        return Outcome(OutcomeKind.busy)
    sentence = body.get("error")
    said = isinstance(sentence, str) and bool(sentence.strip())
    if (code < 400 and status != "error") or (code >= 500 and not said):
        shown = str(status)[:40] if status is not None else "none"
        raise WorkerFault(f"Worker answered HTTP {code} with status {shown}, which is no result, error or busy.")
    error = str(sentence) if said else f"Worker answered HTTP {code}."
    environment = body.get("error_kind") == "environment"
    return Outcome(OutcomeKind.error, error=_sentence(error) if reference else error, environment=environment)


def read_batch(code: int, answer: dict[str, Any], takes: int, reference: bool) -> list[Outcome]:
    """A ``/generate_batch`` answer as one ``Outcome`` per take, in the order they were sent."""
    results = answer.get("results")
    if code != 200 or answer.get("status") != "ok" or not isinstance(results, list):
        return [read_answer(code, answer, reference)] * takes  # the batch as a whole: busy, refused
    if len(results) != takes or not all(isinstance(x, dict) for x in results):
        raise WorkerFault(f"Worker answered {len(results)} results for {takes} takes.")
    return [read_answer(200 if x.get("status") == "ok" else 500, x, reference) for x in results]


def read_task(view: TaskView) -> Outcome | None:
    """A ``GET /tasks/{id}`` answer as an ``Outcome``; None while the task runs.

    Here the worker says ``done`` (the track's word), not ``ok``.
    """
    if view.status == "running":
        return None
    if view.status is TaskState.done and view.result is not None:
        return Outcome(OutcomeKind.done, result=view.result)
    if view.status == "cancelled":
        return Outcome(OutcomeKind.cancelled)
    environment = view.error_kind == "environment"
    return Outcome(OutcomeKind.error, error=view.error or "The task failed on the worker.", environment=environment)


def read_encode(code: int, body: dict[str, Any]) -> WorkerEncodeResult:
    """A ``/encode`` answer: the grid, or why not: ``WorkerBusy`` (409, 503: another worker or later),
    ``EncodeRefused`` (another 4xx: the file itself), ``WorkerFault`` (anything else)."""
    if code == 200 and body.get("status") == "ok":
        try:
            return WorkerEncodeResult.model_validate(body)
        except ValidationError as exc:
            raise WorkerFault(f"Worker encoding is not the contract: {_first_error(exc)}.") from None
    sentence = body.get("error")
    said = str(sentence) if isinstance(sentence, str) and sentence.strip() else f"Worker answered HTTP {code}."
    if code in (409, 503):
        raise WorkerBusy(said)
    if 400 <= code < 500:
        raise EncodeRefused(said)
    raise WorkerFault(f"Worker could not encode ({said})")


def read_adapter_answer(code: int, body: dict[str, Any]) -> dict[str, Any]:
    """A ``PUT /adapters/{name}`` answer: the adapter as the worker read it, or why not:
    ``AdapterRefused`` (a 4xx: the file it names, or ``name``, and the worker's reason), ``WorkerFault``."""
    if code == 200 and body.get("status") == "ok" and isinstance(body.get("sha256"), str):
        return body
    sentence = body.get("error")
    said = str(sentence) if isinstance(sentence, str) and sentence.strip() else f"Worker answered HTTP {code}."
    if 400 <= code < 500:
        detail = body.get("detail")
        entry = detail[0] if isinstance(detail, list) and detail and isinstance(detail[0], dict) else {}
        loc = entry.get("loc") if isinstance(entry.get("loc"), list) else []
        field = str(loc[-1]) if loc else "weights"
        msg = entry.get("msg")
        reason = str(msg) if isinstance(msg, str) and msg else said
        raise AdapterRefused(field, reason, code)
    raise WorkerFault(f"Worker could not take the adapter ({said})")


def result_files(res: WorkerGenerateResult) -> dict[str, str]:
    """The worker's file names of a finished track, by the kind we store it as (a reference worker has no JSON)."""
    names = {"wav": res.wav_filename, "mp3": res.mp3_filename}
    if res.json_filename:
        names["json"] = res.json_filename
    if res.codes_filename:
        names["codes"] = res.codes_filename
    return names


def result_metadata(res: WorkerGenerateResult, worker_id: int) -> dict[str, Any]:
    """What a track's view keeps of the worker's metadata, with the worker that made it."""
    meta = {k: res.metadata.get(k) for k in METADATA_KEYS} | {"worker_id": worker_id}
    meta |= {k: res.metadata[k] for k in BATCH_KEYS if k in res.metadata}
    return meta


def result_seed(res: WorkerGenerateResult, asked: int) -> int:
    """The seed the worker used, which the track shows from now on (a worker reads ``seed_override`` 0
    as its own seed, as the reference does, and answers with the one it used as ``seed``)."""
    return res.seed if res.seed is not None else asked


def _first_error(exc: ValidationError) -> str:
    """The first thing wrong in an answer, with where (``wav_filename: Input should be a valid string``)."""
    first = exc.errors()[0]
    where = ".".join(str(x) for x in first["loc"])
    return f"{where}: {clean_msg(first['msg'])}" if where else clean_msg(first["msg"])


def _sentence(error: str) -> str:
    """The reference worker sends a whole traceback as its error: keep its last line."""
    lines = [ln.strip() for ln in error.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "The task failed on the worker."
