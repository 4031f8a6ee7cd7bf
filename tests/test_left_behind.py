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

from tests.procs import MARK, marked
from tests.support import ROOT, free_port, wait_for

pytestmark = pytest.mark.process


def code_copy(tmp: Path) -> Path:
    """The package and the worker's entry point in a folder of their own: its ``checkpoints/tiny`` is not built."""
    root = tmp / "copy"
    shutil.copytree(ROOT / "songserve", root / "songserve", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "backend_worker.py", root / "backend_worker.py")
    return root


def start_marked_worker(root: Path, tmp: Path, mark: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    log = open(tmp / "worker.log", "ab")
    args = ["backend_worker.py", "--worker-port", str(port), "--master-port", "0", "--output-dir", str(tmp / "out")]
    env = {**os.environ, MARK: mark, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, *args], cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    return proc, f"http://127.0.0.1:{port}"


def healthy(proc: subprocess.Popen[bytes], url: str, log: Path) -> bool:
    assert proc.poll() is None, log.read_text()[-3000:]
    try:
        return httpx.get(url + "/health", timeout=2).json().get("status") == "idle"
    except httpx.HTTPError:
        return False


def test_a_worker_killed_after_building_the_tiny_set_leaves_no_process(tmp_path):
    root, mark = code_copy(tmp_path), uuid.uuid4().hex
    proc, url = start_marked_worker(root, tmp_path, mark)
    try:
        wait_for(lambda: healthy(proc, url, tmp_path / "worker.log"), timeout=300, interval=0.5)
        assert (root / "checkpoints" / "tiny" / "MANIFEST.json").is_file()  # this worker built it
        log = (tmp_path / "worker.log").read_text()
        assert "building the tiny checkpoint set" in log
        assert "tiny checkpoint set ready" in log
        quiet = ("Transformer Engine", "Apex is not installed", "Megatron-FSDP")  # silenced unless LOG_LEVEL=debug
        assert not [n for n in quiet if n in log], log
        before = marked(mark)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        try:
            wait_for(lambda: not marked(mark), timeout=15, interval=0.2)
        except TimeoutError:
            pytest.fail(f"left behind after kill -9: {marked(mark)} (before the kill: {before})")
    finally:
        for pid in marked(mark):
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_worker_killed_while_building_the_tiny_set_leaves_no_process(tmp_path):
    root, mark = code_copy(tmp_path), uuid.uuid4().hex
    proc, url = start_marked_worker(root, tmp_path, mark)
    try:

        def building() -> bool:
            assert proc.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
            return (root / "checkpoints" / ".tiny.building").is_dir() and len(marked(mark)) > 1

        wait_for(building, timeout=120, interval=0.05)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        try:
            wait_for(lambda: not marked(mark), timeout=15, interval=0.2)
        except TimeoutError:
            pytest.fail(f"left behind after kill -9 during the build: {marked(mark)}")
        # The next worker builds the set from scratch (the half-built folder is replaced) and serves.
        again, url = start_marked_worker(root, tmp_path, mark)
        wait_for(lambda: healthy(again, url, tmp_path / "worker.log"), timeout=300, interval=0.5)
        again.terminate()
        assert again.wait(timeout=60) == 0
    finally:
        for pid in marked(mark):
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
