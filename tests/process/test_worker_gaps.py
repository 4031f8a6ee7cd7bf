"""Small guards: bounded worker fields, model names checked first, monotonic stalls,
and a header-read timeout against slowloris connections (real sockets, real processes).
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import httpx
import pytest

from songserve.pipeline.context import TaskContext
from songserve.pipeline.testing.tone import TonePipeline
from songserve.process.settings import load_settings
from songserve.schemas import WorkerStatus
from songserve.worker import runtime as runtime_mod
from songserve.worker.device import ToneDevice
from songserve.worker.runtime import WorkerRuntime
from songserve.worker.settings import WorkerSettings
from tests.support.http import TLS
from tests.support.servers import ServerProcess, free_port, start_worker, wait_for


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gaps")
    w = start_worker(tmp, "--pipeline", "test", "--test-delay-s", "0.5", "--header-timeout-sec", "1")
    w.wait_healthy()
    yield w
    w.stop()


def _post_raw(url: str, raw: bytes) -> httpx.Response:
    return httpx.post(
        url + "/generate", content=raw, headers={"Content-Type": "application/json"}, timeout=30, verify=TLS
    )


# -- bounds and patterns ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (b'{"seed_override": 18446744073709551616}', "seed_override"),
        (b'{"seed_override": 9223372036854775808}', "seed_override"),
        (b'{"tags": "pop \\ud800 rock"}', "tags"),
        (b'{"lyrics": "\\udfff"}', "lyrics"),
        (b'{"job_id": "abc\\n2026-01-01 INFO forged line"}', "job_id"),
        (b'{"superres_name": "x\\u0000y"}', "superres_name"),
        (b'{"raw_mode": "vocal; rm -rf"}', "raw_mode"),
        (b'{"track_index": 100000}', "track_index"),
    ],
)
def test_bad_fields_are_422_naming_the_field(worker, raw: bytes, field: str) -> None:
    r = _post_raw(worker.url, raw)
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["status"] == "error"
    assert f"'{field}'" in body["error"]
    assert body["detail"]


def test_unknown_model_names_are_refused_before_any_work(worker) -> None:
    done_before = httpx.get(worker.url + "/health", timeout=10, verify=TLS).json()["tasks_done"]
    for field in ("superres_name", "backbone_name"):
        r = httpx.post(
            worker.url + "/generate",
            json={"duration": 0.02, "task_id": f"bad-{field}", field: "nope"},
            timeout=30,
            verify=TLS,
        )
        assert r.status_code == 400, r.text
        body = r.json()
        assert body["error_kind"] == "request"
        assert "'nope'" in body["error"]
        assert "available:" in body["error"]
        # refused before the task began: the worker never ran it, so it neither remembers nor counts it
        assert httpx.get(f"{worker.url}/tasks/bad-{field}", timeout=10, verify=TLS).status_code == 404
    h = httpx.get(worker.url + "/health", timeout=10, verify=TLS).json()
    assert h["status"] == "idle"
    assert h["tasks_done"] == done_before


def test_a_valid_request_still_runs(worker) -> None:
    payload = {
        "duration": 0.02,
        "tags": "pop, 钢琴",
        "lyrics": "héllo\n世界",
        "seed_override": 2**63 - 1,
        "job_id": "j-1",
    }
    r = httpx.post(worker.url + "/generate", json=payload, timeout=60, verify=TLS)
    assert r.status_code == 200, r.text
    assert r.json()["seed"] == 2**63 - 1
    assert r.json()["error_kind"] is None


# -- monotonic stall clock --------------------------------------------------------------------------


def _busy_runtime(tmp_path: Path, stall: float) -> tuple[WorkerRuntime, TaskContext]:
    s = load_settings(WorkerSettings, [], pipeline="test", output_dir=tmp_path, stall_timeout_sec=stall)
    rt = WorkerRuntime(s, TonePipeline(s), ToneDevice())
    ctx = TaskContext("t-stall")
    ctx.report("backbone", 1, 10)
    rt.status = WorkerStatus.idle  # loaded, then claimed: the moves the table allows
    rt.tasks.batch, rt.status = [ctx], WorkerStatus.busy
    return rt, ctx


def test_a_wall_clock_step_is_not_a_stall(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rt, _ = _busy_runtime(tmp_path, stall=300)
    real = time.time
    monkeypatch.setattr(runtime_mod.time, "time", lambda: real() + 301)  # the clock jumps forward
    assert rt.health().status == "busy"


def test_no_progress_on_the_monotonic_clock_is_a_stall(tmp_path: Path) -> None:
    rt, ctx = _busy_runtime(tmp_path, stall=0.05)
    wait_for(lambda: rt.health().status == "stalled", timeout=10)
    ctx.report("backbone", 2, 10)  # progress again
    assert rt.health().status == "busy"


# -- header-read timeout ----------------------------------------------------------------------------


def _slowloris(port: int, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # headers never finish
        socks.append(s)
    return socks


def _closed_by_server(s: socket.socket) -> bool:
    try:
        return s.recv(4096) == b""  # blocks (up to the socket timeout) until the server closes
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_slowloris_connections_are_closed(worker) -> None:
    socks = _slowloris(worker.port, 50)
    try:
        assert httpx.get(worker.url + "/health", timeout=10, verify=TLS).status_code == 200  # still serving meanwhile
        assert all(_closed_by_server(s) for s in socks)
    finally:
        for s in socks:
            s.close()


def test_trickled_bytes_do_not_reset_the_deadline(worker) -> None:
    """One byte at a time keeps a plain keep-alive timer from firing; the header deadline still does."""
    s = socket.create_connection(("127.0.0.1", worker.port), timeout=30)
    try:
        s.settimeout(0.2)
        sent = 0
        for ch in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200:
            try:
                s.sendall(bytes([ch]))
                sent += 1
            except (BrokenPipeError, ConnectionResetError):
                break
            try:
                if s.recv(1) == b"":
                    break
            except TimeoutError:
                continue
            except ConnectionResetError:  # closed, and a byte sent after the close came back as a reset
                break
        assert sent < 240  # closed before the trickle ended (≈ 48 s at one byte per 0.2 s)
    finally:
        s.close()


def test_keep_alive_connection_gets_the_same_deadline(worker) -> None:
    s = socket.create_connection(("127.0.0.1", worker.port), timeout=30)
    try:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = b""
        while b"\r\n\r\n" not in first:
            first += s.recv(4096)
        assert first.startswith(b"HTTP/1.1 200")
        length = int(next(h for h in first.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1])
        body = first.split(b"\r\n\r\n", 1)[1]
        while len(body) < length:
            body += s.recv(4096)
        assert json.loads(body)["status"] in ("idle", "busy")
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # the second request never finishes
        assert _closed_by_server(s)
    finally:
        s.close()


@pytest.mark.process
def test_dispatcher_closes_slowloris_connections(tmp_path: Path) -> None:
    port = free_port()
    args = ["backend_api.py", "--port", str(port), "--num-workers", "0", "--state-dir", str(tmp_path)]
    api = ServerProcess([*args, "--header-timeout-sec", "1"], port, tmp_path / "api.log")
    try:
        api.wait_healthy(want=("ok",), timeout=60)
        socks = _slowloris(port, 20)
        try:
            assert all(_closed_by_server(s) for s in socks)
            assert httpx.get(api.url + "/health", timeout=10, verify=TLS).status_code == 200
        finally:
            for s in socks:
                s.close()
    finally:
        api.stop()
