"""Workers started by hand on one host: Megatron's process group needs no port unless given one, and
then listens on loopback only; nothing a worker opens can be reached from another host unless asked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.launcher import REFERENCE_MASTER_PORT, held
from tests.support.listeners import listening, not_on_loopback
from tests.support.servers import ROOT, ServerProcess, free_port


def hand_started_worker(tmp: Path, name: str, env: dict[str, str] | None = None) -> ServerProcess:
    """A tiny-set worker as a person starts one: a port and nothing about the process group."""
    port = free_port()
    args = ["backend_worker.py", "--worker-port", str(port), "--output-dir", str(tmp / f"{name}_audio")]
    return ServerProcess(args, port, tmp / f"{name}.log", env)


@pytest.fixture
def no_master_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MASTER_PORT", "MASTER_ADDR", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.usefixtures("no_master_env")
def test_two_workers_started_by_hand_come_up_next_to_a_process_holding_8791(tiny_dir, tmp_path):
    with held(REFERENCE_MASTER_PORT):
        workers = [hand_started_worker(tmp_path, f"w{i}") for i in range(2)]
        try:
            for w in workers:
                w.wait_healthy(timeout=240)
            for w in workers:
                assert not_on_loopback(w.proc.pid) == [], w.log_tail()
                assert REFERENCE_MASTER_PORT not in [p for _, p in listening(w.proc.pid)]
        finally:
            for w in workers:
                w.stop()


@pytest.mark.usefixtures("no_master_env")
def test_master_port_from_the_environment_is_honoured_on_loopback_only(tiny_dir, tmp_path):
    port = free_port()
    w = hand_started_worker(tmp_path, "w", env={"MASTER_PORT": str(port)})  # as the reference's launcher sets it
    try:
        w.wait_healthy(timeout=240)
        assert ("127.0.0.1", port) in listening(w.proc.pid)
        assert not_on_loopback(w.proc.pid) == []
    finally:
        w.stop()


@pytest.mark.usefixtures("no_master_env")
def test_a_master_port_in_use_refuses_with_one_line_naming_it(tiny_dir, tmp_path):
    port = free_port()
    with held(port, "0.0.0.0"):
        out = subprocess.run(
            [sys.executable, "backend_worker.py", "--worker-port", str(free_port()), "--master-port", str(port)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=240,
        )
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        f"worker: MASTER_PORT {port}: cannot listen on 127.0.0.1 (Address already in use); unset MASTER_PORT "
        "(a worker needs no port for its process group) or choose a free one"
    )
