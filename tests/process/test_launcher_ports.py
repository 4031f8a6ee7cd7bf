"""``run_backend.sh`` and ports it does not own: a port held by anything else ends the launch before it
starts a process, in one line naming the setting that moves it; a process answering on a child's port is
taken for that child only if it echoes the nonce the launcher gave it; nothing is left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from tests.support.http import TLS
from tests.support.launcher import REFERENCE_MASTER_PORT, held, launcher_env
from tests.support.listeners import holding_env, listening, not_on_loopback
from tests.support.servers import ROOT, wait_for, wait_launched


class OtherInstance(ThreadingHTTPServer):
    """Another songserve on a port: its /health says it is up, with a nonce that is not ours."""

    def __init__(self, port: int, health: dict[str, object]) -> None:
        body = json.dumps(health).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200 if self.path == "/health" else 401)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", port), Handler)
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.shutdown()
        self.server_close()


@pytest.fixture
def env(tmp_path: Path) -> Iterator[dict[str, str]]:
    """The launcher's environment for one run (its LOG_DIR marks its processes); stops them at the end."""
    e = launcher_env(tmp_path)
    del e["BASE_MASTER_PORT"]  # as the README runs it: no port settings
    for name in ("MASTER_PORT", "MASTER_ADDR"):
        e.pop(name, None)
    yield e
    subprocess.run(["bash", "run_backend.sh", "stop"], cwd=ROOT, env=e, capture_output=True, timeout=120)


def left_behind(env: dict[str, str]) -> list[int]:
    return holding_env(f"LOG_DIR={env['LOG_DIR']}")


def test_the_readme_first_command_starts_next_to_a_process_holding_8791(tiny_dir, env, tmp_path):
    api = f"http://127.0.0.1:{env['API_PORT']}"
    with held(REFERENCE_MASTER_PORT), open(tmp_path / "launcher.out", "wb") as out:
        proc = subprocess.Popen(["bash", "run_backend.sh"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_launched(proc, api, tmp_path / "launcher.out")
            worker = int((Path(env["LOG_DIR"]) / "worker_0.pid").read_text())
            assert not_on_loopback(worker) == []
            assert REFERENCE_MASTER_PORT not in [p for _, p in listening(worker)]
            assert httpx.get(api + "/health", verify=TLS).json()["launch_nonce"].endswith("-api")
        finally:
            subprocess.run(["bash", "run_backend.sh", "stop"], cwd=ROOT, env=env, capture_output=True, timeout=120)
            proc.wait(timeout=60)
    assert left_behind(env) == []


def test_a_busy_api_port_ends_the_launch_in_one_line_before_anything_starts(tiny_dir, env):
    other = OtherInstance(int(env["API_PORT"]), {"status": "ok", "version": "0.1.0", "accepting": True})
    try:
        out = subprocess.run(
            ["bash", "run_backend.sh", "--no-follow"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
        )
    finally:
        other.close()
    assert out.returncode != 0, out.stdout
    assert out.stderr.strip().splitlines() == [
        f"run_backend: port {env['API_PORT']} (the dispatcher) on 127.0.0.1 is in use; set API_PORT to a free port"
    ]
    assert "ready" not in out.stdout
    assert not list(Path(env["LOG_DIR"]).glob("*.pid"))  # nothing was started
    assert left_behind(env) == []


def test_a_worker_port_answering_with_another_nonce_is_not_taken_for_ours(tiny_dir, env, tmp_path):
    port = int(env["WORKER_BASE_PORT"])
    pid_file = Path(env["LOG_DIR"]) / "worker_0.pid"
    with open(tmp_path / "launcher.out", "w+b") as log:
        proc = subprocess.Popen(
            ["bash", "run_backend.sh", "--no-follow"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            # The ports were free when checked; another instance takes the worker's port between that
            # check and our worker's bind (it imports torch and loads its models first, seconds later).
            wait_for(lambda: pid_file.exists() or proc.poll() is not None, timeout=120)
            other = OtherInstance(port, {"status": "idle", "task_id": None, "launch_nonce": "0123abcd-worker0"})
            try:
                code = proc.wait(timeout=240)
            finally:
                other.close()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        text = (tmp_path / "launcher.out").read_text()
    assert code != 0, text
    assert "worker 0 is up" not in text
    assert f"run_backend: port {port} answers for another process, not the worker 0 started here" in text
    assert "set WORKER_BASE_PORT to a free port" in text
    wait_for(lambda: left_behind(env) == [], timeout=60)  # the worker it started is stopped, not orphaned


@pytest.mark.parametrize(("its_nonce", "stopped"), [("aaaa1111-worker0", True), ("bbbb2222-worker0", False)])
def test_stop_ends_only_the_processes_its_own_launch_started(env, its_nonce, stopped):
    logs = Path(env["LOG_DIR"])
    logs.mkdir()
    (logs / "launch_nonce").write_text("aaaa1111\n")  # the launch that wrote these pid files
    code = "import time; print('up', flush=True); time.sleep(120)"
    proc = subprocess.Popen(  # its command line names backend_worker.py, as every one of ours does
        [sys.executable, "-c", code, "backend_worker.py"],
        env={**os.environ, "LAUNCH_NONCE": its_nonce},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "up\n"
        (logs / "worker_0.pid").write_text(f"{proc.pid}\n")  # a stale pid another launch's worker now has
        out = subprocess.run(
            ["bash", "run_backend.sh", "stop"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        assert ("removing stale pid file" in out.stdout) is not stopped, out.stdout
        if stopped:
            assert proc.wait(timeout=30) == -signal.SIGTERM
        else:
            assert proc.poll() is None  # another launch's process is left running
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
