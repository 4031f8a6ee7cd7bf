"""The dispatcher's only way to talk to a worker: typed calls in, typed answers out.

Every worker URL is formed here. The calls go over three HTTP clients by purpose (``WorkerHttp``),
so that one kind of traffic can never take the connections another needs: ``control`` (health,
config, task views, cancels, file removal: short calls whose silence marks a worker offline),
``work`` (tasks held while they run, encodings, result downloads) and ``live`` (the live-audio
relays, one per live track, ``service/live_feed.py``). With one shared pool of 200, 200 listeners filled
it: the health polls waited for a connection, timed out, and both workers were judged offline. The
bodies sent and the answers read are translated in ``workers/to_worker.py`` (the one place that renames a
field for a worker); here, transport failures raise ``WorkerUnreachable``, answers that are not the
contract (not a JSON object, wrong fields, a file it cannot serve or that outgrows the cap) raise
``WorkerFault``, and a worker that answered is summarised as an ``Outcome`` (``outcomes.py``).
A result file comes as a stream of chunks (``file_chunks``); the copy on disk, its checks and the
download deadline are the artifact store's (``artifacts.py``).

Two dialects, picked from the worker's ``/health`` (``WorkerHealth.kind``):
- ``songserve``: our worker, with task ids, ``/cancel``, ``/tasks``, ``/generate_batch`` and a JSON
  file per track;
- ``reference``: the reference backend's worker. It has no task ids: progress comes from its health
  while it runs our track; no ``/cancel``: a cancel discards its result; no ``/tasks``: a track it
  ran before a dispatcher restart is re-queued; no JSON file; no file removal (its own sweep).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from pydantic import ValidationError

from songserve.api.workers import to_worker
from songserve.api.workers.outcomes import Outcome, TaskLost, WorkerFault, WorkerUnreachable
from songserve.schemas import TaskView, WorkerConfig, WorkerEncodeResult, WorkerGenerateRequest, WorkerHealth
from songserve.schemas.common import ADAPTER_CONFIG, ADAPTER_WEIGHTS

FILE_TIMEOUT = 60.0  # seconds between two chunks of a file (the whole copy has its own deadline)
CHUNK = 1 << 16
CONTROL_TIMEOUT = 5.0
# A live stream is quiet between its last audio and its take's end (super-resolution, decoder, files);
# past this the relay asks again, so a worker that hangs never holds a listener for good.
LIVE_READ_TIMEOUT = 20.0
SONGSERVE, REFERENCE = "songserve", "reference"
LEASE_HEADER = "Songserve-Lease"  # worker/fence.py reads it

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerHttp:
    """The dispatcher's HTTP clients to its workers, one per kind of traffic (see the module docstring)."""

    control: httpx.AsyncClient
    work: httpx.AsyncClient
    live: httpx.AsyncClient

    @classmethod
    def shared(cls, http: httpx.AsyncClient) -> WorkerHttp:
        """One client for everything (tests that inject a transport)."""
        return cls(http, http, http)

    @classmethod
    @asynccontextmanager
    async def open(
        cls, headers: dict[str, str], live_connections: int, keepalive_sec: float
    ) -> AsyncIterator[WorkerHttp]:
        """The three clients, closed at the end. ``control`` and ``work`` have no cap on connections: what
        they carry is bounded by the fleet (a health poll and a few task calls per worker, a task and its
        file copies per running track), so a call never waits for a connection of our own; ``live`` is
        capped at ``live_connections`` (one per live track, each with at least one listener)."""
        free = httpx.Limits(max_connections=None, max_keepalive_connections=50, keepalive_expiry=keepalive_sec)
        live = httpx.Limits(max_connections=live_connections, max_keepalive_connections=0)
        # One TLS context for the three: each client would otherwise build its own, loading the
        # system's certificates on the event loop (about 170 ms each on a loaded machine).
        tls = httpx.create_ssl_context()
        async with AsyncExitStack() as stack:
            clients = [httpx.AsyncClient(headers=headers, limits=limits, verify=tls) for limits in (free, free, live)]
            for client in clients:
                await stack.enter_async_context(client)
            yield cls(*clients)


class WorkerClient:
    def __init__(self, http: WorkerHttp, url: str) -> None:
        self.http = http
        self.url = url.rstrip("/")
        self.kind = SONGSERVE  # updated from every health answer

    @property
    def reference(self) -> bool:
        return self.kind == REFERENCE

    async def _call(
        self, method: str, path: str, timeout: httpx.Timeout | float, work: bool = False, **kw: object
    ) -> httpx.Response:
        """One call on the control client (``work``: on the work client)."""
        http = self.http.work if work else self.http.control
        try:
            return await http.request(method, self.url + path, timeout=timeout, **kw)  # type: ignore[arg-type]
        except httpx.HTTPError as exc:
            raise WorkerUnreachable(f"Worker {self.url} did not answer ({type(exc).__name__}).") from exc

    @staticmethod
    def _json(r: httpx.Response) -> dict[str, Any]:
        try:
            body = r.json()
        except ValueError:
            raise WorkerFault(f"Worker answered HTTP {r.status_code} with a body that is not JSON.") from None
        if not isinstance(body, dict):
            raise WorkerFault(f"Worker answered HTTP {r.status_code} with a body that is not an object.")
        return body

    async def health(self, timeout: float) -> WorkerHealth:
        r = await self._call("GET", "/health", timeout)
        if r.status_code != 200:
            raise WorkerUnreachable(f"Worker health answered HTTP {r.status_code}.")
        try:
            health = WorkerHealth.model_validate(self._json(r))
        except ValidationError as exc:
            raise WorkerFault(f"Worker health is not the contract: {exc.errors()[0]['msg']}.") from None
        self.kind = health.kind
        return health

    async def config(self) -> WorkerConfig:
        r = await self._call("GET", "/config", CONTROL_TIMEOUT)
        if r.status_code != 200:
            raise WorkerUnreachable(f"Worker config answered HTTP {r.status_code}.")
        try:
            return WorkerConfig.model_validate(self._json(r))
        except ValidationError as exc:
            raise WorkerFault(f"Worker config is not the contract: {exc.errors()[0]['msg']}.") from None

    async def generate(self, req: WorkerGenerateRequest, lease: str | None = None) -> Outcome:
        """Run one track; returns when the worker answers (no read timeout: the caller bounds it).

        ``lease``: ``<store id> <epoch>`` the task is sent under (our worker refuses a stale one, 409)."""
        body = to_worker.generate_body(req, self.reference)
        headers = {LEASE_HEADER: lease} if lease else {}
        r = await self._call("POST", "/generate", httpx.Timeout(10, read=None), True, json=body, headers=headers)
        return to_worker.read_answer(r.status_code, self._json(r), self.reference)

    async def generate_batch(self, reqs: list[WorkerGenerateRequest], lease: str | None = None) -> list[Outcome]:
        """Run takes of one request as one batch (``POST /generate_batch``): one outcome per take."""
        if len(reqs) == 1:
            return [await self.generate(reqs[0], lease)]
        body = to_worker.batch_body(reqs)
        headers = {LEASE_HEADER: lease} if lease else {}
        r = await self._call("POST", "/generate_batch", httpx.Timeout(10, read=None), True, json=body, headers=headers)
        return to_worker.read_batch(r.status_code, self._json(r), len(reqs), self.reference)

    async def encode(
        self, audio: bytes | AsyncIterator[bytes], task_id: str, timeout: float, lease: str | None = None
    ) -> WorkerEncodeResult:
        """An upload's file as codes (``POST /encode``, ours only), within ``timeout`` seconds.

        ``BusyAnswer`` when it cannot take it now (busy, draining, no encoder); ``WorkerRefused`` for
        a 4xx about the file; ``WorkerUnreachable`` / ``WorkerFault`` as for every call."""
        headers = {"Content-Type": "application/octet-stream", **({LEASE_HEADER: lease} if lease else {})}
        r = await self._call(
            "POST", "/encode", timeout, True, params={"task_id": task_id}, content=audio, headers=headers
        )
        return to_worker.read_encode(r.status_code, self._json(r))

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
            raise WorkerFault(f"Worker task view is not the contract: {exc.errors()[0]['msg']}.") from None
        return to_worker.read_task(view)

    async def remove_files(self, task_id: str) -> None:
        """Tell the worker its files for ``task_id`` are collected (it deletes them); best effort."""
        if self.reference:
            return
        r = await self._call("DELETE", f"/files/{task_id}", CONTROL_TIMEOUT)
        if r.status_code not in (200, 404):
            raise WorkerUnreachable(f"Worker could not remove the files of {task_id} (HTTP {r.status_code}).")

    async def put_adapter(self, name: str, config: Path, weights: Path, timeout: float) -> dict[str, Any]:
        """Send an uploaded adapter's two files (``PUT /adapters/{name}``, ours only); the worker checks
        them against its models. ``AdapterRefused`` names the file it refused and why."""
        with config.open("rb") as c, weights.open("rb") as w:
            files = {
                "config": (ADAPTER_CONFIG, c, "application/json"),
                "weights": (ADAPTER_WEIGHTS, w, "application/octet-stream"),
            }
            r = await self._call("PUT", f"/adapters/{name}", httpx.Timeout(timeout), True, files=files)
        return to_worker.read_adapter_answer(r.status_code, self._json(r))

    async def delete_adapter(self, name: str, sha256: str | None = None) -> bool:
        """Remove an uploaded adapter from the worker (with ``sha256``: only the copy of that digest).
        True when the worker holds no copy of that name from now on (removed, or it had none); False
        when it kept another copy (409)."""
        params = {"sha256": sha256} if sha256 else None
        r = await self._call("DELETE", f"/adapters/{name}", CONTROL_TIMEOUT, params=params)
        if r.status_code not in (200, 404, 409):
            raise WorkerUnreachable(f"Worker could not remove adapter {name} (HTTP {r.status_code}).")
        return r.status_code != 409

    async def live_chunks(self, task_id: str, start: int) -> AsyncGenerator[bytes, None]:
        """A running take's live audio (16-bit PCM, 44.1 kHz stereo) from byte ``start`` on, as the worker
        makes it (``GET /tasks/{id}/stream``). Ends when the take ends or has no (more) live audio;
        nothing at all from a worker that has none for it (409) or from a reference worker.
        ``WorkerFault`` when the worker does not know the task (404): the dispatcher marks a track
        generating before its request reaches the worker, so a listener can ask in between; the relay
        asks again. ``WorkerUnreachable`` when the connection breaks or stays silent past
        ``LIVE_READ_TIMEOUT``."""
        if self.reference:
            return
        url = f"{self.url}/tasks/{task_id}/stream"
        timeout = httpx.Timeout(CONTROL_TIMEOUT, read=LIVE_READ_TIMEOUT)
        try:
            async with self.http.live.stream("GET", url, params={"start": start}, timeout=timeout) as r:
                if r.status_code == 404:
                    raise WorkerFault(f"Worker {self.url} does not know task {task_id} (yet).")
                if r.status_code != 200:
                    return
                async for chunk in r.aiter_raw(CHUNK):
                    yield chunk
        except httpx.HTTPError as exc:
            raise WorkerUnreachable(
                f"Live audio of {task_id} from worker {self.url} broke ({type(exc).__name__})."
            ) from exc

    async def file_chunks(self, filename: str, max_bytes: int) -> AsyncGenerator[bytes, None]:
        """The bytes of one result file as they arrive (close it with ``contextlib.aclosing``).

        ``WorkerFault`` when the worker cannot serve it, when it announces or sends more than
        ``max_bytes``, or when the transfer breaks (the copy is short). A connection that breaks before
        the answer's status line is asked once more: a pooled keep-alive connection the worker closed
        as it was reused (seen on loopback under load) is not the worker's fault.
        """
        for last_try in (False, True):
            try:
                async for chunk in self._file_chunks_once(filename, max_bytes):
                    yield chunk  # only after the status line: no chunk comes before a _NoAnswer
                return
            except _NoAnswer as exc:
                if last_try:
                    raise WorkerFault(
                        f"Copying {filename} from worker {self.url} broke ({type(exc.__cause__).__name__})."
                    ) from exc.__cause__
                log.info(
                    "copying %s from worker %s: no answer (%s); asking once more",
                    filename,
                    self.url,
                    type(exc.__cause__).__name__,
                )

    async def _file_chunks_once(self, filename: str, max_bytes: int) -> AsyncGenerator[bytes, None]:
        url = f"{self.url}/download/{filename}"
        started = False
        try:
            async with self.http.work.stream("GET", url, timeout=FILE_TIMEOUT) as r:
                started = True
                # The reference worker answers a missing file with 200 and a JSON error body.
                json_error = r.headers.get("content-type", "").startswith("application/json")
                if r.status_code != 200 or (json_error and not filename.endswith(".json")):
                    raise WorkerFault(f"Worker could not serve {filename} (HTTP {r.status_code}).")
                announced = r.headers.get("content-length", "")
                if announced.isdigit() and int(announced) > max_bytes:
                    raise WorkerFault(f"{filename} is {int(announced)} bytes, over the cap of {max_bytes} bytes.")
                size = 0
                async for chunk in r.aiter_bytes(CHUNK):
                    size += len(chunk)
                    if size > max_bytes:
                        raise WorkerFault(f"{filename} grew past the cap of {max_bytes} bytes.")
                    yield chunk
        except httpx.HTTPError as exc:
            if not started:
                raise _NoAnswer() from exc
            raise WorkerFault(f"Copying {filename} from worker {self.url} broke ({type(exc).__name__}).") from exc


class _NoAnswer(Exception):
    """A download's connection broke before its status line (``WorkerClient.file_chunks``)."""
