"""In-process workers behind ``httpx.MockTransport``: the dispatcher's state machine without processes.

Each ``FakeWorker`` answers the worker's HTTP surface (shared/docs/api.md, "Worker") from memory. A
test decides how each ``POST /generate`` ends by putting a ``Plan`` in the worker's queue; the request
then waits until the plan's ``release`` event is set (or answers at once), so a test can look at the
dispatcher while a track runs. Faults are plain flags: ``down`` refuses connections, ``forget``
makes ``/tasks`` answer 404, ``drip`` makes every download send a byte now and then, for ever,
``progress`` is what ``/health`` reports. A WAV it serves is a real one
(mono, 8-bit, 100 Hz) as long as its result says, so the dispatcher's checks of the copy pass.
"""

from __future__ import annotations

import asyncio
import functools
import io
import json
import time
import wave
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from songserve.api.compose import Checked, Parts, assemble
from songserve.api.http.tags import TAGS
from songserve.api.results.artifacts import ArtifactStore
from songserve.api.service.job_service import JobService
from songserve.api.service.keys import ApiKeys
from songserve.api.settings import DispatcherSettings
from songserve.api.store.sqlite.store import SqliteStore
from songserve.api.workers.client import WorkerHttp
from songserve.schemas import GenerateRequest, JobView


def tiny_wav(seconds: float, rate: int = 100) -> bytes:
    """A real WAV of ``seconds`` (mono, 8-bit, ``rate`` Hz): a few hundred bytes."""
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(1)
        w.setframerate(rate)
        w.writeframes(b"\x80" * round(seconds * rate))
    return out.getvalue()


async def _drip() -> AsyncIterator[bytes]:
    while True:
        yield b"R"
        await asyncio.sleep(0.05)


@dataclass
class Plan:
    """How one generate call ends: "ok", "error", "cancelled", "busy", "drop" (connection lost) or
    "garbage" (a 200 without a result's fields, at once)."""

    outcome: str = "ok"
    release: asyncio.Event | None = None  # None: answer at once
    error: str = "The model failed."
    environment: bool = False  # an error of the worker's own (its disk, memory): error_kind environment


@dataclass
class FakeWorker:
    url: str
    down: bool = False
    forget: bool = False
    drip: bool = False
    max_batch: int = 1
    batches: list[list[str]] = field(default_factory=list)  # task ids of each /generate_batch call
    disk_low: bool = False
    phase: str = "idle"
    progress: int = 0
    detail: str = ""
    rate: float | None = None
    running: list[str] = field(default_factory=list)  # task ids it runs now (several: a batch)
    plans: deque[Plan] = field(default_factory=deque)
    generated: list[str] = field(default_factory=list)  # task ids that started
    cancels: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)  # task ids whose files the dispatcher released
    finished: dict[str, dict[str, object]] = field(default_factory=dict)
    _cancelled: set[str] = field(default_factory=set)

    def health(self) -> dict[str, object]:
        busy = self.task_id is not None
        return {
            "status": "busy" if busy else "idle",
            "phase": self.phase if busy else "idle",
            "progress": self.progress,
            "progress_detail": self.detail,
            "tokens_per_sec": self.rate,
            "task_id": self.task_id,
            "tasks": [
                {
                    "task_id": i,
                    "phase": self.phase,
                    "progress": self.progress,
                    "progress_detail": self.detail,
                    "tokens_per_sec": self.rate,
                }
                for i in self.running
            ],
            "backbone_models": ["default_backbone"],
            "superres_models": ["default_superres"],
            "disk_low": self.disk_low,
        }

    async def generate(self, body: dict[str, object]) -> httpx.Response:
        """Runs the plan as the worker's own task: a dropped request does not stop the work."""
        plan = self.plans.popleft() if self.plans else Plan()
        if plan.outcome == "busy" or self.task_id is not None:
            return httpx.Response(409, json={"status": "busy", "error": "busy"})
        if plan.outcome == "garbage":
            self.generated.append(str(body["task_id"]))
            return httpx.Response(200, json={"status": "ok"})
        work = asyncio.ensure_future(self._work(str(body["task_id"]), plan, body.get("seed_override")))
        status, answer = await asyncio.shield(work)
        if plan.outcome == "drop":
            raise httpx.RemoteProtocolError("connection lost")
        return httpx.Response(status, json=answer)

    async def generate_batch(self, takes: list[dict[str, object]]) -> httpx.Response:
        """All takes as one work unit with one plan; each take answers like ``/generate``."""
        plan = self.plans.popleft() if self.plans else Plan()
        if self.task_id is not None:
            return httpx.Response(409, json={"status": "busy", "error": "busy"})
        ids = [str(t["task_id"]) for t in takes]
        self.batches.append(ids)
        work = [
            asyncio.ensure_future(self._work(i, plan, t.get("seed_override"))) for i, t in zip(ids, takes, strict=True)
        ]
        answers = await asyncio.shield(asyncio.gather(*work))
        return httpx.Response(200, json={"status": "ok", "results": [a for _, a in answers]})

    @property
    def task_id(self) -> str | None:
        return self.running[0] if self.running else None

    @task_id.setter
    def task_id(self, value: str | None) -> None:  # None: the worker restarted, it runs nothing
        self.running = [] if value is None else [value]

    async def _work(self, task_id: str, plan: Plan, seed: object) -> tuple[int, dict[str, object]]:
        self.generated.append(task_id)
        self.running.append(task_id)
        self.phase, self.progress = "backbone", 0
        try:
            if plan.release is not None:
                while not plan.release.is_set() and task_id not in self._cancelled:
                    await asyncio.sleep(0.005)
        finally:
            if task_id in self.running:
                self.running.remove(task_id)
            if not self.running:
                self.phase = "idle"
        if task_id in self._cancelled or plan.outcome == "cancelled":
            self.finished[task_id] = {"task_id": task_id, "status": "cancelled"}
            return 200, {"status": "cancelled", "task_id": task_id}
        if plan.outcome == "error":
            kind = "environment" if plan.environment else "model"
            self.finished[task_id] = {"task_id": task_id, "status": "error", "error": plan.error, "error_kind": kind}
            return 500, {"status": "error", "error": plan.error, "error_kind": kind}
        result: dict[str, object] = {
            "status": "ok",
            "task_id": task_id,
            "wav_filename": f"{task_id}.wav",
            "mp3_filename": f"{task_id}.mp3",
            "json_filename": f"{task_id}.json",
            "duration_sec": 3.0,
            "backbone_tokens": 130,
            "gpu_id": 0,
            "seed": seed,
            "metadata": {"models": {"backbone": "default_backbone"}, "timings": {"backbone_sec": 0.1}},
        }
        self.finished[task_id] = {"task_id": task_id, "status": "done", "result": result}
        return 200, result

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        path = request.url.path
        if path == "/health":
            return httpx.Response(200, json=self.health())
        if path == "/config":
            models = {"backbone_models": ["default_backbone"], "superres_models": ["default_superres"]}
            limits = {"max_batch": self.max_batch, "max_sequence_length": 25600, "tokens_per_minute": 2584}
            return httpx.Response(200, json={**models, **limits})
        if path == "/generate_batch":
            return await self.generate_batch(json.loads(request.content)["takes"])
        if path == "/generate":
            return await self.generate(json.loads(request.content))
        if path.startswith("/cancel/"):
            task_id = path.rsplit("/", 1)[1]
            self.cancels.append(task_id)
            if task_id in self.running:
                self._cancelled.add(task_id)
                return httpx.Response(200, json={"task_id": task_id, "status": "running"})
            if task_id in self.finished:
                return httpx.Response(200, json=self.finished[task_id])
            return httpx.Response(404, json={"status": "error", "error": "unknown task"})
        if path.startswith("/tasks/"):
            task_id = path.rsplit("/", 1)[1]
            if self.forget:
                return httpx.Response(404, json={"status": "error", "error": "unknown task"})
            if task_id in self.running:
                return httpx.Response(200, json={"task_id": task_id, "status": "running"})
            if task_id in self.finished:
                return httpx.Response(200, json=self.finished[task_id])
            return httpx.Response(404, json={"status": "error", "error": "unknown task"})
        if path.startswith("/files/") and request.method == "DELETE":
            self.removed.append(path.rsplit("/", 1)[1])
            return httpx.Response(200, json={"removed": []})
        if path.startswith("/download/") and self.drip:
            return httpx.Response(200, content=_drip())
        if path.startswith("/download/"):
            return httpx.Response(200, content=tiny_wav(3.0) if path.endswith(".wav") else b"ID3" + path.encode())
        return httpx.Response(404, json={"status": "error", "error": "No such route."})


class FakeFleet:
    """N fake workers and a dispatcher's parts (``compose.assemble``) wired to them through one ``MockTransport``:
    ``parts``, and ``svc``, its job service."""

    def __init__(self, tmp: Path, n: int = 1, max_batch: int = 1, **settings: object) -> None:
        self.workers = [FakeWorker(f"http://worker{i}.test", max_batch=max_batch) for i in range(n)]
        by_host = {httpx.URL(w.url).host: w for w in self.workers}

        async def route(request: httpx.Request) -> httpx.Response:
            return await by_host[request.url.host].handle(request)

        defaults: dict[str, object] = {"health_interval": 0.02, "stall_timeout_sec": 30.0, "sweep_interval_sec": 3600}
        self.settings = DispatcherSettings(
            state_dir=tmp, worker_urls=",".join(w.url for w in self.workers), **{**defaults, **settings}
        )
        self.tmp = tmp
        self.http = httpx.AsyncClient(transport=httpx.MockTransport(route))
        self.parts = assemble_parts(self.settings, self.tmp, self.http)
        self.svc = self.parts.jobs

    def new_service(self) -> JobService:
        """A restarted dispatcher: new parts over the same store file and results folder."""
        self.parts = assemble_parts(self.settings, self.tmp, self.http)
        return self.parts.jobs

    async def __aenter__(self) -> FakeFleet:
        await self.parts.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.parts.stop()
        await self.parts.store.close()

    async def holds(self, job_id: str, check: Callable[[JobView], bool]) -> bool:
        """Whether the job's current view passes ``check`` (for ``until``)."""
        return check(await self.svc.view(job_id))


def assemble_parts(s: DispatcherSettings, tmp: Path, http: httpx.AsyncClient) -> Parts:
    """``compose.assemble`` over a SQLite store in ``tmp`` and ``http`` (a ``MockTransport`` client)."""
    checked = Checked(s, ApiKeys.load(s.api_key, s.api_keys_file), TAGS)
    store = SqliteStore(tmp / "jobs.sqlite3")
    return assemble(checked, store, ArtifactStore(tmp / "results"), WorkerHttp.shared(http))


async def until(predicate: Callable[[], bool | Awaitable[bool]], timeout: float = 10.0) -> None:
    """Wait until ``predicate`` holds (a safety timeout only: tests never assert on time)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if not isinstance(value, bool):
            value = await value
        if value:
            return
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.005)


def aio(fn: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(asyncio.wait_for(fn(*args, **kwargs), 30))

    return run


def body(tracks: int = 1) -> GenerateRequest:
    return GenerateRequest(lyrics="hello", duration=0.05, num_tracks=tracks, seed=5)


def finished(f: FakeFleet, job_id: str) -> Callable[[], bool]:
    return lambda: f.holds(job_id, lambda v: all(t.status in ("done", "error", "cancelled") for t in v.tracks))


async def run_job(f: FakeFleet, tracks: int = 1) -> JobView:
    job_id = (await f.svc.submit(body(tracks))).job_id
    await until(finished(f, job_id))
    return await f.svc.view(job_id)
