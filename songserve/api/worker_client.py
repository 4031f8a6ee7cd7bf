"""The dispatcher's only way to talk to a worker: typed calls in, typed answers out.

Every worker URL is formed here, and every call goes over the dispatcher's one HTTP client. The
bodies sent and the answers read are translated in ``to_worker.py`` (the one place that renames a
field for a worker); here, transport failures and answers that are not JSON objects raise
``WorkerUnreachable``, a worker that answered is summarised as an ``Outcome`` (``outcomes.py``).

Two dialects, picked from the worker's ``/health`` (``WorkerHealth.kind``):
- ``songserve``: our worker, with task ids, ``/cancel``, ``/tasks``, ``/generate_batch`` and a JSON
  file per track;
- ``reference``: the reference backend's worker. It has no task ids: progress comes from its health
  while it runs our track; no ``/cancel``: a cancel discards its result; no ``/tasks``: a track it
  ran before a dispatcher restart is re-queued; no JSON file; no file removal (its own sweep).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

import httpx
from pydantic import ValidationError

from songserve.api import to_worker
from songserve.api.outcomes import Outcome, TaskLost, WorkerUnreachable
from songserve.schemas import TaskView, WorkerConfig, WorkerGenerateRequest, WorkerHealth

FILE_TIMEOUT = 60.0
CONTROL_TIMEOUT = 5.0
SONGSERVE, REFERENCE = "songserve", "reference"
LEASE_HEADER = "Songserve-Lease"  # worker/fence.py reads it


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

    async def generate(self, req: WorkerGenerateRequest, lease: str | None = None) -> Outcome:
        """Run one track; returns when the worker answers (no read timeout: the caller bounds it).

        ``lease``: ``<store id> <epoch>`` the task is sent under (our worker refuses a stale one, 409)."""
        body = to_worker.generate_body(req, self.reference)
        headers = {LEASE_HEADER: lease} if lease else {}
        r = await self._call("POST", "/generate", httpx.Timeout(10, read=None), json=body, headers=headers)
        return to_worker.read_answer(r.status_code, self._json(r), self.reference)

    async def generate_batch(self, reqs: list[WorkerGenerateRequest], lease: str | None = None) -> list[Outcome]:
        """Run takes of one request as one batch (``POST /generate_batch``): one outcome per take."""
        if len(reqs) == 1:
            return [await self.generate(reqs[0], lease)]
        body = to_worker.batch_body(reqs)
        headers = {LEASE_HEADER: lease} if lease else {}
        r = await self._call("POST", "/generate_batch", httpx.Timeout(10, read=None), json=body, headers=headers)
        return to_worker.read_batch(r.status_code, self._json(r), len(reqs), self.reference)

    async def cancel(self, task_id: str, timeout: float = CONTROL_TIMEOUT) -> bool:
        """Ask the worker to stop ``task_id``; False when it does not know the task (nothing runs).

        A reference worker cannot stop a task: False, so the caller discards the attempt instead.
        """
        if self.reference:
            return False
        r = await self._call("POST", f"/cancel/{task_id}", timeout)
        return r.status_code != 404

    async def task(self, task_id: str, lease: str | None = None) -> Outcome | None:
        """What became of a task: None while it runs; raises ``TaskLost`` when the worker forgot it.

        ``lease``: the asker's; from then on the worker refuses tasks sent under an older one."""
        if self.reference:
            raise TaskLost(f"worker {self.url} (reference) cannot report task {task_id}")
        headers = {LEASE_HEADER: lease} if lease else {}
        r = await self._call("GET", f"/tasks/{task_id}", CONTROL_TIMEOUT, headers=headers)
        if r.status_code == 404:
            raise TaskLost(f"worker {self.url} lost task {task_id}")
        try:
            view = TaskView.model_validate(self._json(r))
        except ValidationError as exc:
            raise WorkerUnreachable(f"Worker task view is not the contract: {exc.errors()[0]['msg']}.") from None
        return to_worker.read_task(view)

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
