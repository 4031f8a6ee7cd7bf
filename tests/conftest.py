import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.servers import ROOT

# One tiny-model worker per test process, shared by the model tests; the work units and their order.
pytest_plugins = ["tests.support.tiny_site", "tests.support.schedule"]

# The fused step's Triton kernels run under Triton's interpreter where there is no GPU: set before
# anything (megatron-core, at its import) imports triton, which fixes the mode for the process.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A run started in the background of a non-interactive shell (a CI runner) inherits SIGINT ignored, and
# so would every launcher it starts: bash cannot trap a signal ignored on entry, and the Ctrl-C tests
# would test nothing. A handler of our own is reset to the default in every child at exec.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_sessionfinish() -> None:
    from tests.support import zygote

    zygote.stop_all()  # the server templates of this test process (tests/support/zygote.py)


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    """The tiny checkpoint set, built once (in a subprocess: dist_checkpointing spawns helpers); a current
    one there is answered without torch's import (``pipeline/tiny/manifest.py``)."""
    out = subprocess.run(
        [sys.executable, "-m", "songserve.pipeline.tiny"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return Path(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def release_dir(tmp_path_factory, worker_id: str) -> Path:
    """The release-shaped tiny set (``tiny --layout release``), built once per run in a subprocess: the
    test processes of one xdist run share it (their temporary folders' parent); the build's own lock
    (``ensure_tiny_set``) lets the first one build it, and the others find it current. Tests only read it."""
    root = tmp_path_factory.getbasetemp()
    out = (root.parent if worker_id != "master" else root) / "release-set" / "khala"
    run = subprocess.run(
        [sys.executable, "-m", "songserve.pipeline.tiny", "--layout", "release", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return out


@pytest.fixture(scope="session")
def megatron_cpu():
    import torch

    from songserve.pipeline.checkpoints.megatron_env import init_megatron

    torch.set_num_threads(1)
    init_megatron(torch.device("cpu"), 0, seed=0)
    return torch.device("cpu")


@pytest.fixture(scope="session")
def pg_server():
    """A throw-away PostgreSQL server for the whole session (tests/support/pg.py); skipped, with the reason printed,
    where none can be started here."""
    from tests.support import pg

    why = pg.unavailable()
    if why:
        print(f"\nPostgreSQL tests skipped: {why}", file=sys.stderr)
        pytest.skip(f"no PostgreSQL server: {why}")
    server = pg.start_server()
    yield server
    server.stop()


@pytest.fixture
def pg_url(pg_server) -> Iterator[str]:
    """A fresh, empty database on the session's server, dropped after the test: its postgresql:// URL."""
    name = pg_server.create_database()
    yield pg_server.url(name)
    pg_server.drop_database(name)
