"""The launcher (``run_backend.sh``) as the tests run it: its environment on free ports, one run of it,
a port held while it starts, and the third-party start-up noise its logs must not carry."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

from tests.support.servers import ROOT, free_port

NOISE = ("Transformer Engine", "Apex is not installed", "Duplicate Operation ID", "Megatron-FSDP")


def launcher_env(tmp: Path, **extra: str) -> dict:
    env = {
        **os.environ,
        "API_PORT": str(free_port()),
        "WORKER_BASE_PORT": str(free_port()),
        "BASE_MASTER_PORT": "0",  # no port for the process groups (also the default now)
        "LOG_DIR": str(tmp / "logs"),
        "STATE_DIR": str(tmp / "state"),
        "HEALTH_TIMEOUT": "180",
        **extra,
    }
    # Worker ports are base+i: make sure base+1 is free too by picking a base with a free neighbour.
    while True:
        base = free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", base + 1))
            break
        except OSError:
            continue
    env["WORKER_BASE_PORT"] = str(base)
    return env


def run_launcher(args: list[str], env: dict[str, str], cwd: Path = ROOT, timeout: int = 400):
    return subprocess.run(
        ["bash", str(ROOT / "run_backend.sh"), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


REFERENCE_MASTER_PORT = 8791  # the port the reference's launcher (and once ours) gave worker 0


@contextlib.contextmanager
def held(port: int, host: str = "127.0.0.1") -> Iterator[None]:
    """A listener on ``host:port`` for the block (if something else holds it already, so much the better)."""
    sock = socket.socket()
    try:
        sock.bind((host, port))
        sock.listen()
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
    try:
        yield
    finally:
        sock.close()
