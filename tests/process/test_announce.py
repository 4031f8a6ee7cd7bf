"""Workers that announce themselves: a real worker against a real HTTP stand-in dispatcher.

The stand-in answers the ``POST /workers`` / ``DELETE /workers/{id}`` contract and records every
request, including whether the worker's own ``/health`` answered when its announcement arrived.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from songserve.errors import ConfigError
from songserve.process.settings import load_settings
from songserve.schemas import WorkerAnnounced, WorkerAnnouncement
from songserve.worker import announce
from songserve.worker.settings import WorkerSettings
from songserve.worker.urls import default_public_url, dispatcher_urls, local_health_url
from tests.support.http import TLS
from tests.support.launcher import launcher_env
from tests.support.servers import ROOT, free_port, start_worker, wait_for, worker_refusal

TOKEN = "announce-secret"


@dataclass
class StandIn:
    """A dispatcher's ``/workers`` routes, recording what arrives; ``fail_first`` POSTs answer 503."""

    url: str = ""
    fail_first: int = 0
    requests: list[dict[str, Any]] = field(default_factory=list)
    ids: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def posts(self) -> list[dict[str, Any]]:
        with self.lock:
            return [r for r in self.requests if r["method"] == "POST"]

    def deletes(self) -> list[dict[str, Any]]:
        with self.lock:
            return [r for r in self.requests if r["method"] == "DELETE"]

    def app(self) -> FastAPI:
        app = FastAPI()

        def record(request: Request, **extra: Any) -> None:
            with self.lock:
                self.requests.append({"method": request.method, "auth": request.headers.get("authorization"), **extra})

        @app.post("/workers")
        def join(request: Request, body: dict[str, Any]) -> JSONResponse:  # sync: runs in a thread, may block
            ann = WorkerAnnouncement.model_validate(body)
            try:  # the contract says a worker announces only once it answers /health
                health = httpx.get(ann.url + "/health", timeout=5, verify=TLS).status_code
            except httpx.HTTPError:
                health = None
            record(request, body=body, health=health)
            if request.headers.get("authorization") != f"Bearer {TOKEN}":
                return JSONResponse({"status": "error", "error": "Wrong worker token."}, status_code=401)
            if len(self.posts()) <= self.fail_first:
                return JSONResponse({"status": "error", "error": "Store is starting."}, status_code=503)
            with self.lock:
                worker_id = self.ids.setdefault(ann.url, len(self.ids) + 3)
            return JSONResponse(WorkerAnnounced(worker_id=worker_id, expires_in_sec=ann.ttl_sec).model_dump())

        @app.delete("/workers/{worker_id}")
        def leave(request: Request, worker_id: int) -> JSONResponse:
            record(request, worker_id=worker_id)
            if worker_id not in self.ids.values():
                return JSONResponse({"status": "error", "error": f"Worker {worker_id} not found."}, status_code=404)
            return JSONResponse({"worker_id": worker_id, "left": True})

        return app


@pytest.fixture
def stand_in() -> Iterator[StandIn]:
    yield from _serve(StandIn())


@pytest.fixture
def flaky_stand_in() -> Iterator[StandIn]:
    yield from _serve(StandIn(fail_first=2))


def _serve(d: StandIn) -> Iterator[StandIn]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(d.app(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, timeout=20)
    d.url = f"http://127.0.0.1:{port}"
    yield d
    server.should_exit = True
    thread.join(10)


def announcing_worker(tmp, targets: str, name: str = "worker", interval: float = 0.4):
    return start_worker(
        tmp,
        "--pipeline",
        "test",
        "--worker-token",
        TOKEN,
        "--announce",
        targets,
        "--announce-interval-sec",
        str(interval),
        name=name,
    )


def announce_view(worker) -> list[dict[str, Any]]:
    r = httpx.get(worker.url + "/config", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5, verify=TLS)
    assert r.status_code == 200, r.text
    return r.json()["announce"]


# ---- real processes -------------------------------------------------------------------------------


@pytest.mark.process
def test_announces_renews_and_leaves_on_sigterm(tmp_path, stand_in):
    w = announcing_worker(tmp_path, stand_in.url + "/")
    try:
        w.wait_healthy()
        wait_for(lambda: len(stand_in.posts()) >= 2, timeout=30)  # the first announcement and a renewal
        posts = stand_in.posts()
        for p in posts:
            assert p["auth"] == f"Bearer {TOKEN}"
            assert p["body"]["url"] == w.url  # HOST 127.0.0.1 → http://127.0.0.1:<port>
            assert p["body"]["ttl_sec"] == pytest.approx(1.2)  # 3 × the interval
            assert p["health"] == 200  # it was answering /health when it announced
        view = wait_for(lambda: (v := announce_view(w)) and v[0]["state"] == "joined" and v, timeout=10)
        assert view[0]["url"] == stand_in.url
        assert view[0]["worker_id"] == 3
        assert view[0]["renewals"] >= 1
        assert view[0]["last_error"] is None

        w.signal(signal.SIGTERM)
        assert w.proc.wait(30) == 0
        deletes = stand_in.deletes()
        assert [d["worker_id"] for d in deletes] == [3]
        assert deletes[0]["auth"] == f"Bearer {TOKEN}"
        log = w.log_tail(20000)
        assert log.count(f"announce {stand_in.url}: joined as worker 3") == 1  # logged once, not per renewal
        assert f"announce {stand_in.url}: left as worker 3" in log
    finally:
        w.stop()


@pytest.mark.process
def test_failing_dispatchers_back_off_and_never_stop_the_worker(tmp_path, flaky_stand_in):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens here
    w = announcing_worker(tmp_path, f"{flaky_stand_in.url},{dead}")
    try:
        w.wait_healthy()
        # two 503s, then it joins: the back-off retries sooner than the interval, capped by it
        wait_for(lambda: len(flaky_stand_in.posts()) >= 4, timeout=30)
        view = {v["url"]: v for v in wait_for(lambda: _joined(w, flaky_stand_in.url), timeout=10)}
        assert view[flaky_stand_in.url]["worker_id"] == 3
        assert view[dead]["state"] == "failing"
        assert view[dead]["worker_id"] is None
        assert "Connect" in view[dead]["last_error"]
        assert httpx.get(w.url + "/health", timeout=5, verify=TLS).json()["status"] == "idle"  # still serving

        log = w.log_tail(20000)
        assert log.count(f"announce {dead}: failing") == 1  # many retries, one line per change
        assert log.count(f"announce {flaky_stand_in.url}: failing (worker -): HTTP 503: Store is starting.") == 1

        w.signal(signal.SIGTERM)
        assert w.proc.wait(30) == 0
        assert [d["worker_id"] for d in flaky_stand_in.deletes()] == [3]  # leaves only where it had joined
    finally:
        w.stop()


def _joined(w, url: str) -> list[dict[str, Any]] | None:
    view = announce_view(w)
    return view if any(v["url"] == url and v["state"] == "joined" for v in view) else None


@pytest.mark.process
def test_wrong_token_is_reported_not_fatal(tmp_path, stand_in):
    w = start_worker(
        tmp_path,
        "--pipeline",
        "test",
        "--worker-token",
        "not-the-dispatchers",
        "--announce",
        stand_in.url,
        "--announce-interval-sec",
        "0.3",
    )
    try:
        w.wait_healthy()
        wait_for(lambda: len(stand_in.posts()) >= 2, timeout=30)
        r = httpx.get(w.url + "/config", headers={"Authorization": "Bearer not-the-dispatchers"}, timeout=5, verify=TLS)
        (view,) = r.json()["announce"]
        assert view["state"] == "failing"
        assert view["last_error"] == "HTTP 401: Wrong worker token."
        w.signal(signal.SIGTERM)
        assert w.proc.wait(30) == 0
        assert stand_in.deletes() == []  # never joined: nothing to leave
    finally:
        w.stop()


@pytest.mark.process
def test_launcher_passes_announce_to_its_workers(tmp_path, stand_in):
    env = launcher_env(tmp_path, PIPELINE="test", WORKER_TOKEN=TOKEN, ANNOUNCE_INTERVAL_SEC="0.4")
    start = ["bash", "run_backend.sh", "--workers-only", "--no-follow", "--announce", stand_in.url]
    try:
        out = subprocess.run(start, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr
        base = int(env["WORKER_BASE_PORT"])
        wait_for(lambda: {p["body"]["url"] for p in stand_in.posts()} == {f"http://127.0.0.1:{base}"}, timeout=60)
    finally:
        stop = subprocess.run(["bash", "run_backend.sh", "stop"], cwd=ROOT, env=env, capture_output=True, timeout=90)
    assert stop.returncode == 0
    assert [d["worker_id"] for d in stand_in.deletes()] == [3]  # it left on the launcher's stop


@pytest.mark.process
def test_launcher_refuses_announce_without_a_token(tmp_path):
    env = launcher_env(tmp_path, WORKER_TOKEN="off")
    out = subprocess.run(
        ["bash", "run_backend.sh", "--workers-only", "--announce", "http://d:8889"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 1
    assert out.stderr.strip() == "run_backend: --announce needs WORKER_TOKEN set to the dispatchers' worker token"


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("--announce", "ftp://dispatcher:8889", "--worker-token", TOKEN), ["announce", "'ftp://dispatcher:8889'"]),
        (("--announce", "http://dispatcher:8889"), ["announce", "WORKER_TOKEN"]),
        (
            ("--announce", "http://d:8889", "--worker-token", TOKEN, "--public-url", "http://me:8001/x"),
            ["public_url", "'http://me:8001/x'"],
        ),
    ],
)
def test_bad_announce_settings_refuse_start_up(args, words):
    out = worker_refusal("--pipeline", "test", *args, timeout=60, fresh=True)  # its whole stderr is one line
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    for w in words:
        assert w in lines[0]


# ---- units ---------------------------------------------------------------------------------------


def test_public_url_defaults(monkeypatch):
    monkeypatch.setattr(socket, "getfqdn", lambda *a: "gpu7.example.net")
    assert default_public_url("0.0.0.0", 8001) == "http://gpu7.example.net:8001"
    assert default_public_url("::", 8002) == "http://gpu7.example.net:8002"
    assert default_public_url("10.0.0.5", 8001) == "http://10.0.0.5:8001"
    assert default_public_url("fe80::1", 8001) == "http://[fe80::1]:8001"
    assert local_health_url("0.0.0.0", 8001) == "http://127.0.0.1:8001/health"
    assert local_health_url("::", 8001) == "http://[::1]:8001/health"

    s = load_settings(WorkerSettings, ["--announce", "http://d:8889", "--worker-token", "t", "--host", "0.0.0.0"])
    assert s.public_url == "http://gpu7.example.net:8001"
    s = load_settings(WorkerSettings, ["--announce", "http://d:8889", "--worker-token", "t", "--worker-port", "9"])
    assert s.public_url == "http://127.0.0.1:9"
    s = load_settings(WorkerSettings, ["--announce", "http://d", "--worker-token", "t", "--public-url", "https://w/"])
    assert s.public_url == "https://w"
    assert load_settings(WorkerSettings, []).public_url == ""  # not announcing: nothing to resolve


def test_dispatcher_urls():
    assert dispatcher_urls(" http://a:1/ ,https://b/prefix/,, http://a:1") == ["http://a:1", "https://b/prefix"]
    for bad in ("a:1", "http://", "http://a?x=1", "http://u:p@a", "mailto:x@y"):
        with pytest.raises(ValueError, match="'"):
            dispatcher_urls(f"http://ok,{bad}")
    with pytest.raises(ConfigError, match="announce_interval_sec"):
        load_settings(WorkerSettings, ["--announce-interval-sec", "0"])


def test_announcement_bounds():
    assert WorkerAnnouncement(url="http://w:8001/").url == "http://w:8001"
    for url in ("http://w:8001/x", "http://w:8001?a", "ws://w", "http://" + "w" * 200):
        with pytest.raises(ValidationError):
            WorkerAnnouncement(url=url)
    for ttl in (0.5, 3601, float("nan")):
        with pytest.raises(ValidationError):
            WorkerAnnouncement(url="http://w", ttl_sec=ttl)
    assert announce.ttl_for(5.0) == 15.0  # three intervals: two lost renewals are tolerated
    assert announce.ttl_for(0.1) == 1.0  # 3 × 0.1 is below the contract's minimum
    assert announce.ttl_for(1200) == 3600.0
