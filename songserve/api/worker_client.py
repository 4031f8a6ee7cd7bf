"""The dispatcher's only way to talk to a worker: typed calls in, typed answers out.

Every worker URL is formed here, and every body is (de)serialised through the contract models in
``songserve.schemas``. Transport failures and unreadable answers raise ``WorkerUnreachable``; a
worker that answered is summarised as an ``Outcome``:

    done       the track finished; ``result`` names its files
    error      the model failed with a clear sentence (not retried)
    cancelled  the worker stopped the task (ours or its own shutdown)
    busy       the worker was running something else; the track never started

Two dialects, picked from the worker's ``/health`` (``WorkerHealth.kind``):
- ``songserve``: our worker, with task ids, ``/cancel``, ``/tasks`` and a JSON file per track;
- ``reference``: the reference backend's worker. It has no task ids: progress comes from its health
  while it runs our track; no ``/cancel``: a cancel discards its result; no ``/tasks``: a track it
  ran before a dispatcher restart is re-queued; no JSON file; whole-minute durations, the
  instrumental prompt only for ``language: "Instrumental"``, and the reference dispatcher's
  ``superres_text_mode``. Its errors carry a traceback: the last line is kept as the sentence.
"""

from __future__ import annotations

import math
import os
import secrets
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import httpx
from pydantic import ValidationError

from songserve.api.store import Job, Track
from songserve.errors import SongserveError
from songserve.schemas import (
    TaskState,
    TaskView,
    WorkerConfig,
    WorkerGenerateRequest,
    WorkerGenerateResult,
    WorkerHealth,
)

FILE_TIMEOUT = 60.0
CONTROL_TIMEOUT = 5.0
SONGSERVE, REFERENCE = "songserve", "reference"
REFERENCE_SUPERRES_TEXT_MODE = "same_as_backbone_no_description"  # what the reference dispatcher sends


class WorkerUnreachable(SongserveError):
    """No usable answer: connection refused or lost, a timeout, or a body that is not the contract."""


class OutcomeKind(StrEnum):
    done = "done"
    error = "error"
    cancelled = "cancelled"
    busy = "busy"


@dataclass(frozen=True)
class Outcome:
    kind: OutcomeKind
    result: WorkerGenerateResult | None = None
    error: str = ""
    environment: bool = False  # the failure is the worker's (disk, memory, writes), not the track's


def worker_request(job: Job, t: Track) -> WorkerGenerateRequest:
    """The worker payload for one attempt of one track (shared/docs/api.md, "Worker payload")."""
    r = job.request
    natural = r.prompt_mode == "natural"
    style = r.prompt if natural else r.tags
    return WorkerGenerateRequest(
        tags="" if natural else r.tags,
        description=r.prompt if natural else "",
        duration=r.duration,
        lyrics=job.cleaned_lyrics,
        backbone_name=r.backbone or "",
        superres_name=r.superres or "",
        top_k_bb=r.top_k_bb,
        top_k_sr=r.top_k_sr,
        temperature=r.temperature,
        raw_user_input=style,
        raw_mode=r.mode,
        raw_prompt_mode=r.prompt_mode,
        seed_override=t.seed,
        task_id=t.task_id or "",
        job_id=job.job_id,
        track_index=t.index,
    )


def reference_request(req: WorkerGenerateRequest) -> dict[str, Any]:
    """Our payload as the reference worker reads it (its ``GenerateRequest``)."""
    instrumental = req.raw_mode == "instrumental"
    return {
        **req.model_dump(exclude={"task_id", "job_id", "track_index"}),
        "language": "Instrumental" if instrumental else "",
        "lyrics": "" if instrumental else req.lyrics,
        "duration": max(1, math.ceil(req.duration - 1e-9)),  # it takes whole minutes only
        "superres_text_mode": REFERENCE_SUPERRES_TEXT_MODE,
    }


def _sentence(error: str) -> str:
    """The reference worker sends a whole traceback as its error: keep its last line."""
    lines = [ln.strip() for ln in error.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "The task failed on the worker."


class WorkerClient:
    def __init__(self, http: httpx.AsyncClient, url: str) -> None:
        self.http = http
        self.url = url.rstrip("/")
        self.kind = SONGSERVE  # updated from every health answer

    @property
    def reference(self) -> bool:
        return self.kind == REFERENCE

    async def _call(self, method: str, path: str, timeout: httpx.Timeout | float, **kw: object) -> httpx.Response:
        try:
            return await self.http.request(method, self.url + path, timeout=timeout, **kw)  # type: ignore[arg-type]
        except httpx.HTTPError as exc:
            raise WorkerUnreachable(f"Worker {self.url} did not answer ({type(exc).__name__}).") from exc

    @staticmethod
    def _json(r: httpx.Response) -> dict[str, Any]:
        try:
            body = r.json()
        except ValueError:
            raise WorkerUnreachable(f"Worker answered HTTP {r.status_code} with a body that is not JSON.") from None
        if not isinstance(body, dict):
            raise WorkerUnreachable(f"Worker answered HTTP {r.status_code} with a body that is not an object.")
        return body

    async def health(self, timeout: float) -> WorkerHealth:
        r = await self._call("GET", "/health", timeout)
        if r.status_code != 200:
            raise WorkerUnreachable(f"Worker health answered HTTP {r.status_code}.")
        try:
            health = WorkerHealth.model_validate(self._json(r))
        except ValidationError as exc:
            raise WorkerUnreachable(f"Worker health is not the contract: {exc.errors()[0]['msg']}.") from None
        self.kind = health.kind
        return health

    async def config(self) -> WorkerConfig:
        r = await self._call("GET", "/config", CONTROL_TIMEOUT)
        if r.status_code != 200:
            raise WorkerUnreachable(f"Worker config answered HTTP {r.status_code}.")
        try:
            return WorkerConfig.model_validate(self._json(r))
        except ValidationError as exc:
            raise WorkerUnreachable(f"Worker config is not the contract: {exc.errors()[0]['msg']}.") from None

    async def generate(self, req: WorkerGenerateRequest) -> Outcome:
        """Run one track; returns when the worker answers (no read timeout: the caller bounds it)."""
        body = reference_request(req) if self.reference else req.model_dump()
        r = await self._call("POST", "/generate", httpx.Timeout(10, read=None), json=body)
        return self._outcome(r.status_code, self._json(r))

    async def generate_batch(self, reqs: list[WorkerGenerateRequest]) -> list[Outcome]:
        """Run takes of one request as one batch (``POST /generate_batch``): one outcome per take."""
        if len(reqs) == 1:
            return [await self.generate(reqs[0])]
        body = {"takes": [r.model_dump() for r in reqs]}
        r = await self._call("POST", "/generate_batch", httpx.Timeout(10, read=None), json=body)
        answer = self._json(r)
        results = answer.get("results")
        if r.status_code != 200 or answer.get("status") != "ok" or not isinstance(results, list):
            return [self._outcome(r.status_code, answer)] * len(reqs)  # the batch as a whole: busy, refused
        if len(results) != len(reqs) or not all(isinstance(x, dict) for x in results):
            raise WorkerUnreachable(f"Worker answered {len(results)} results for {len(reqs)} takes.")
        return [self._outcome(200 if x.get("status") == "ok" else 500, x) for x in results]

    def _outcome(self, code: int, body: dict[str, Any]) -> Outcome:
        status = body.get("status")
        if status == "ok":
            try:
                return Outcome(OutcomeKind.done, result=WorkerGenerateResult.model_validate(body))
            except ValidationError as exc:
                raise WorkerUnreachable(f"Worker result is not the contract: {exc.errors()[0]['msg']}.") from None
        if status == "cancelled":
            return Outcome(OutcomeKind.cancelled)
        if status == "busy" or code == 409:
            return Outcome(OutcomeKind.busy)
        if code == 503:  # draining: it takes no new task, another worker will
            return Outcome(OutcomeKind.busy)
        error = str(body.get("error") or f"Worker answered HTTP {code}.")
        environment = body.get("error_kind") == "environment"
        return Outcome(OutcomeKind.error, error=_sentence(error) if self.reference else error, environment=environment)

    async def cancel(self, task_id: str, timeout: float = CONTROL_TIMEOUT) -> bool:
        """Ask the worker to stop ``task_id``; False when it does not know the task (nothing runs).

        A reference worker cannot stop a task: False, so the caller discards the attempt instead.
        """
        if self.reference:
            return False
        r = await self._call("POST", f"/cancel/{task_id}", timeout)
        return r.status_code != 404

    async def task(self, task_id: str) -> Outcome | None:
        """What became of a task: None while it runs; raises ``TaskLost`` when the worker forgot it."""
        if self.reference:
            raise TaskLost(f"worker {self.url} (reference) cannot report task {task_id}")
        r = await self._call("GET", f"/tasks/{task_id}", CONTROL_TIMEOUT)
        if r.status_code == 404:
            raise TaskLost(f"worker {self.url} lost task {task_id}")
        try:
            view = TaskView.model_validate(self._json(r))
        except ValidationError as exc:
            raise WorkerUnreachable(f"Worker task view is not the contract: {exc.errors()[0]['msg']}.") from None
        if view.status == "running":
            return None
        if view.status is TaskState.done and view.result is not None:
            return Outcome(OutcomeKind.done, result=view.result)
        if view.status == "cancelled":
            return Outcome(OutcomeKind.cancelled)
        environment = view.error_kind == "environment"
        return Outcome(OutcomeKind.error, error=view.error or "The task failed on the worker.", environment=environment)

    async def remove_files(self, task_id: str) -> None:
        """Tell the worker its files for ``task_id`` are collected (it deletes them); best effort."""
        if self.reference:
            return
        r = await self._call("DELETE", f"/files/{task_id}", CONTROL_TIMEOUT)
        if r.status_code not in (200, 404):
            raise WorkerUnreachable(f"Worker could not remove the files of {task_id} (HTTP {r.status_code}).")

    async def download(self, filename: str, dest: Path) -> int:
        """Stream one result file into ``dest`` atomically (temporary name, then rename); returns bytes."""
        tmp = dest.with_name(f".{dest.name}.{secrets.token_hex(3)}.tmp")
        size = 0
        try:
            async with self.http.stream("GET", f"{self.url}/download/{filename}", timeout=FILE_TIMEOUT) as r:
                # The reference worker answers a missing file with 200 and a JSON error body.
                json_error = r.headers.get("content-type", "").startswith("application/json") and dest.suffix != ".json"
                if r.status_code != 200 or json_error:
                    raise WorkerUnreachable(f"Worker could not serve {filename} (HTTP {r.status_code}).")
                with open(tmp, "wb") as f:
                    async for chunk in r.aiter_bytes(1 << 16):
                        f.write(chunk)
                        size += len(chunk)
            os.replace(tmp, dest)
        except httpx.HTTPError as exc:
            raise WorkerUnreachable(
                f"Copying {filename} from worker {self.url} failed ({type(exc).__name__})."
            ) from exc
        finally:
            tmp.unlink(missing_ok=True)
        return size


class TaskLost(SongserveError):
    """The worker does not know the task (it restarted): the track must run again."""
