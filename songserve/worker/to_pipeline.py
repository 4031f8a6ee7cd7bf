"""The one translation between the worker's wire models and the pipeline's types, both ways.

In: a ``WorkerGenerateRequest`` (the dispatcher's payload, docs/api.md "Worker") becomes
the pipeline's ``TrackRequest``. Out: a ``TrackResult`` becomes ``WorkerGenerateResult``, a take
that did not finish becomes its wire answer, and an ``EncodeResult`` (an upload's audio as codes)
becomes ``WorkerEncodeResult``. Nothing else in the worker renames a field; each
rename below says who needs it. The words differ on purpose: a finished take answers ``"ok"`` (the
reference dispatcher checks that word) while the task it was is ``done`` (``TaskState``, our word).
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from songserve.audio.reading import AudioFacts
from songserve.errors import SongserveError, TaskCancelled
from songserve.http.errors import error_response
from songserve.pipeline.types import EncodeResult, Prefix, Repaint, TrackRequest, TrackResult
from songserve.schemas import (
    PrefixCodes,
    ResultFile,
    WorkerBatchResult,
    WorkerEncodeResult,
    WorkerGenerateRequest,
    WorkerGenerateResult,
    WorkerTakeFailure,
)
from songserve.worker.failures import error_kind_of


def take_seed(body: WorkerGenerateRequest, worker_seed: int) -> int:
    """The seed a take runs with: ``seed_override``, where 0 or absent means the worker's own ``SEED``.

    The reference worker reads it as ``seed_override or seed``, so 0 means the same on both.
    Our dispatcher draws its seeds from 1 up: 0 arrives only when a client asked for seed 0.
    """
    return body.seed_override or worker_seed


def track_request(body: WorkerGenerateRequest, worker_seed: int, task_id: str) -> TrackRequest:
    """The pipeline's request for one take; ``task_id`` is the body's, or the one the worker gave it."""
    return TrackRequest(
        lyrics=body.lyrics,
        duration=body.duration,
        genre=body.genre,
        language=body.language,
        tags=body.tags,
        description=body.description,
        # The prompt builder takes one flag. Our dispatcher says instrumental in raw_mode (the
        # client's "mode"); the reference dispatcher says it with language "Instrumental".
        instrumental=body.raw_mode == "instrumental" or body.language.lower() == "instrumental",
        backbone_name=body.backbone_name,
        superres_name=body.superres_name,
        top_k_bb=body.top_k_bb,
        top_k_sr=body.top_k_sr,
        temperature=body.temperature,
        superres_text_mode=body.superres_text_mode,
        seed=take_seed(body, worker_seed),  # the wire's seed_override, after the rule above
        task_id=task_id,
        job_id=body.job_id,
        track_index=body.track_index,
        # What the client sent, as the reference records it: kept in the track's JSON only.
        extra={
            "raw_user_input": body.raw_user_input,
            "raw_mode": body.raw_mode,
            "raw_prompt_mode": body.raw_prompt_mode,
        },
        prefix=prefix(body.prefix) if body.prefix is not None else None,
        preview=body.preview,
        adapter=body.adapter,
        adapter_scale=body.adapter_scale,
    )


def prefix(wire: PrefixCodes) -> Prefix:
    """The wire's base64 grid as the pipeline's ``Prefix`` (the codes decoded once, here)."""
    parts = tuple(Repaint(s.start, s.end, s.window, s.opening) for s in wire.spans())
    return Prefix(wire.raw(), wire.levels, wire.frames, wire.origin, parts[0] if parts else None, parts)


def generate_result(
    task_id: str, got: TrackResult, gpu_id: int, files: dict[str, ResultFile] | None = None
) -> WorkerGenerateResult:
    """A finished take as the wire has it: its files (with their sizes and checksums), its seed, the GPU
    the dispatcher knows it by."""
    return WorkerGenerateResult(
        task_id=task_id,
        mp3_filename=got.mp3_filename,
        wav_filename=got.wav_filename,
        json_filename=got.json_filename,
        codes_filename=got.codes_filename,
        duration_sec=got.duration_sec,
        backbone_tokens=got.backbone_tokens,
        gpu_id=gpu_id,
        seed=got.seed,
        metadata=got.metadata,
        files=files or {},
    )


def take_failure(task_id: str, exc: SongserveError) -> WorkerTakeFailure:
    """A take of a batch that did not finish: cancelled, or its error's sentence."""
    status = "cancelled" if isinstance(exc, TaskCancelled) else "error"
    return WorkerTakeFailure(status=status, task_id=task_id, error=str(exc))


def batch_result(results: list[tuple[str, WorkerGenerateResult | SongserveError]]) -> WorkerBatchResult:
    """``/generate_batch``'s answer: per take (task id, result or error), in the order of the takes."""
    return WorkerBatchResult(
        results=[r if isinstance(r, WorkerGenerateResult) else take_failure(task_id, r) for task_id, r in results]
    )


def generate_failure(task_id: str, exc: SongserveError) -> WorkerTakeFailure | JSONResponse:
    """``/generate``'s answer for a take that did not finish.

    Cancelled: HTTP 200 with ``status: cancelled`` (the task ended as asked). Anything else: the
    error body at the error's status, with its kind (environment, model or request) so the
    dispatcher knows whether another worker may succeed, and the validation detail if any.
    """
    if isinstance(exc, TaskCancelled):
        return take_failure(task_id, exc)
    kind = error_kind_of(exc)
    extra: dict[str, object] = {"error_kind": kind.value} if kind else {}
    if exc.detail:
        extra["detail"] = exc.detail
    return error_response(exc.http_status, str(exc), headers=exc.headers, task_id=task_id, **extra)


def encode_result(task_id: str, got: EncodeResult, facts: AudioFacts) -> WorkerEncodeResult:
    """An encoding as the wire has it: the grid as a ``PrefixCodes`` (what a continuation sends back)."""
    codes = got.codes.astype("<i2", copy=False)
    grid = PrefixCodes.of(codes.tobytes(), int(codes.shape[0]), int(codes.shape[1]))
    return WorkerEncodeResult(
        task_id=task_id,
        grid=grid,
        frame_rate=got.frame_rate,
        hop=got.hop,
        sample_rate=got.sample_rate,
        duration_sec=facts.duration_sec,
        source=facts.describe(),
        timings=got.timings,
    )
