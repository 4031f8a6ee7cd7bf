import os
import shutil
import signal
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import ROOT

pytest_plugins = ["tests.tiny_site"]  # one tiny-model worker per test process, shared by the model tests

# The fused step's Triton kernels run under Triton's interpreter where there is no GPU: set before
# anything (megatron-core, at its import) imports triton, which fixes the mode for the process.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A run started in the background of a non-interactive shell (a CI runner) inherits SIGINT ignored, and
# so would every launcher it starts: bash cannot trap a signal ignored on entry, and the Ctrl-C tests
# would test nothing. A handler of our own is reset to the default in every child at exec.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _one_tls_context_for_default_clients() -> None:
    """httpx makes a TLS context (certifi's CA bundle, read and parsed: ~26 ms of CPU) for every client,
    so for every ``httpx.get``; the tests poll plain-HTTP servers with thousands of those (measured: a
    tenth of the suite's CPU). The contexts of default arguments are one shared context here (a
    context is safe to share between clients and threads); any other arguments get their own."""
    from httpx._transports import default

    make = default.create_ssl_context
    made: dict[bool, ssl.SSLContext] = {}

    def shared(verify: Any = True, cert: Any = None, trust_env: bool = True) -> ssl.SSLContext:
        if verify is not True or cert is not None:
            return make(verify=verify, cert=cert, trust_env=trust_env)
        if trust_env not in made:
            made[trust_env] = make(verify=verify, cert=cert, trust_env=trust_env)
        return made[trust_env]

    default.create_ssl_context = shared


_one_tls_context_for_default_clients()

SPREAD = {"test_bench_smoke.py"}  # slow tests and no module fixtures: each test is a unit of its own
# The launcher's real-process tests run one at a time: two of them hold the reference's port 8791, and
# every one starts the README's command with its workers and dispatcher.
LAUNCHER = {
    "test_launcher.py",
    "test_launcher_stop.py",
    "test_launcher_ports.py",
    "test_ports.py",
    "test_first_hour.py",
    "test_left_behind.py",
    "test_caller_paths.py",
    "test_announce.py",
    "test_reference_requests.py",
}
# The longest units, longest first (measured: seconds of a whole run on two cores), handed out before
# the rest so that no long one starts near the end: the launcher's (about 230 s in one unit), then
# these files, then the benchmarks' smoke runs (3 to 25 s each), then the other files with real-process
# proofs, then everything else.
LONGEST = (
    "launcher",
    "test_scaleout.py",  # 117
    "test_first_hour.py",  # 65 without its launcher tests
    "test_split_brain.py",  # 82
    "test_listeners.py",  # 79
    "test_browser.py",  # 76
    "test_soak.py",  # 61
    "test_decode_modes.py",  # 65
    "test_retake_model.py",  # 40
    "test_bad_workers.py",  # 50
    "test_dispatcher_http.py",  # 55
    "test_security.py",  # 50
    "test_live_http.py",  # 44
    "test_faults.py",  # 45
    "test_engine.py",  # 40
    "test_release_decoder.py",  # 36
)


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which names each test's unit after its mark
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Work units for ``pytest -n N --dist loadgroup --no-loadscope-reorder`` (scripts/test): the
    launcher's ``process`` tests in one unit, run in order on one worker; every other file a unit of its
    own (its module fixtures are built once), but for the files in ``SPREAD``, whose every test is a
    unit. Handed out in the order of ``LONGEST``, so the short ones fill in at the end. Without xdist
    the marks do nothing."""
    process = {item.path.name for item in items if item.get_closest_marker("process")}
    rank: dict[int, int] = {}
    for item in items:
        only = getattr(item.module, "LAUNCHER_TESTS", None)  # a file with a few of the launcher's tests
        if item.path.name in process and item.path.name in LAUNCHER and (only is None or item.originalname in only):
            group = "launcher"
        elif item.path.name in SPREAD:
            group = item.nodeid
        else:
            group = item.path.name
        item.add_marker(pytest.mark.xdist_group(group))
        first = group if group in LONGEST else item.path.name
        if first in LONGEST:
            rank[id(item)] = LONGEST.index(first)
        else:
            rank[id(item)] = len(LONGEST) + (0 if item.path.name in SPREAD else 1 if item.path.name in process else 2)
    items.sort(key=lambda item: rank[id(item)])  # stable: each file keeps its order


def pytest_sessionfinish() -> None:
    from tests import zygote

    zygote.stop_all()  # the server templates of this test process (tests/zygote.py)


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
    """A throw-away PostgreSQL server for the whole session (tests/pg.py); skipped, with the reason printed,
    where none can be started here."""
    from tests import pg

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
