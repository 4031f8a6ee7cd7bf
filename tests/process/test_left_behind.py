"""Nothing left behind: a worker killed with kill -9, and ``run_backend.sh stop``, leave no process.

megatron-core's checkpoint writer starts a ``multiprocessing`` Manager (a spawned server process)
when a set is saved; a worker that built the tiny set in its own process and was then killed
with ``kill -9`` left that Manager running (~270 MB) with nobody to stop it. Every process here
is started with a marker in its environment, which children inherit: after the kill, no process
on the machine may still carry it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from tests.support.http import TLS
from tests.support.launcher import NOISE
from tests.support.procs import MARK, marked
from tests.support.servers import ROOT, free_port, wait_for


def code_copy(tmp: Path) -> Path:
    """The package and the worker's entry point in a folder of their own: its ``checkpoints/tiny`` is not built."""
    root = tmp / "copy"
    shutil.copytree(ROOT / "songserve", root / "songserve", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "backend_worker.py", root / "backend_worker.py")
    return root


def start_marked_worker(root: Path, tmp: Path, mark: str, log_name: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    log = open(tmp / log_name, "ab")
    args = ["backend_worker.py", "--worker-port", str(port), "--master-port", "0", "--output-dir", str(tmp / "out")]
    env = {**os.environ, MARK: mark, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, *args], cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    return proc, f"http://127.0.0.1:{port}"


def healthy(proc: subprocess.Popen[bytes], url: str, log: Path) -> bool:
    assert proc.poll() is None, log.read_text()[-3000:]
    try:
        return httpx.get(url + "/health", timeout=2, verify=TLS).json().get("status") == "idle"
    except httpx.HTTPError:
        return False


def killed_leaves_nothing(proc: subprocess.Popen[bytes], mark: str, when: str) -> None:
    before = marked(mark)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    try:
        wait_for(lambda: not marked(mark), timeout=15, interval=0.2)
    except TimeoutError:
        pytest.fail(f"left behind after kill -9 {when}: {marked(mark)} (before the kill: {before})")


def test_a_worker_killed_while_and_after_building_the_tiny_set_leaves_no_process(tmp_path):
    """Two cold workers on one code copy: the first is killed while it builds the set; the second
    builds it again from scratch (the half-built folder is replaced), serves, and is killed too.
    (One test: each cold worker and build costs about 10 CPU-seconds.)"""
    root, mark = code_copy(tmp_path), uuid.uuid4().hex
    procs = []
    try:
        first, _ = start_marked_worker(root, tmp_path, mark, "first.log")
        procs.append(first)

        def building() -> bool:
            assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            return (root / "checkpoints" / ".tiny.building").is_dir() and len(marked(mark)) > 1

        wait_for(building, timeout=120, interval=0.05)
        killed_leaves_nothing(first, mark, "during the build")

        again, url = start_marked_worker(root, tmp_path, mark, "again.log")
        procs.append(again)
        wait_for(lambda: healthy(again, url, tmp_path / "again.log"), timeout=300, interval=0.5)
        assert (root / "checkpoints" / "tiny" / "MANIFEST.json").is_file()  # this worker built it
        log = (tmp_path / "again.log").read_text()
        assert "building the tiny checkpoint set" in log
        assert "tiny checkpoint set ready" in log
        # A cold start's whole log (test_first_hour's noise check relies on this one): the set loaded,
        # third-party start-up noise silenced unless LOG_LEVEL=debug.
        assert "decoder loaded from" in log
        assert not [n for n in NOISE if n in log], log
        killed_leaves_nothing(again, mark, "after the build")
    finally:
        for pid in marked(mark):
            os.kill(pid, signal.SIGKILL)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
