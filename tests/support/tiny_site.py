"""One tiny-model worker per test process, shared by the model tests (a pytest plugin: tests/conftest.py).

Why: a tiny-model worker costs about 8 CPU-seconds importing torch and megatron-core before it loads
the set, and CI runs the suite on two cores, so one per model test file costs that many times over. Every
file that can run on the same flags asks for ``shared_tiny``: one worker per test process (per xdist
worker), started on first use and stopped at the end of the session. The files on the release-shaped
set share one more (``shared_release``). A file that needs other flags (a decode mode, one_shot
or park, a token budget, other paths) still starts its own.

The worker is ``tests/support/held_worker.py`` (a file's test can hold its backbone) with ``SHARED_FLAGS``.
Tests must not depend on each other's leftovers, so ``tiny_site`` hands the worker over, and takes
it back, reset: no hold file, nothing running, no KV snapshot (their slots and counters, cleared on
SIGUSR1 by held_worker.py). What stays between files is what a test cannot see in a take: the
loaded weights, the output folder's older files and the log (a test reads the whole log file).
Each file puts a dispatcher of its own in front of the worker, over a state folder of its own.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.support.http import TLS
from tests.support.servers import Cluster, ServerProcess, cluster_of, free_port, wait_for

# keep_loaded: superres and decoder stay resident (one_shot loads both for every request: CPU the
# tests do not need); 2 s preview windows: a short live take still has several.
SHARED_FLAGS = ("--runtime-mode", "keep_loaded", "--preview-chunk-sec", "2")
IDLE_WAIT = 600.0  # seconds: a take left running by the file before is cancelled; under load this can take long


class SharedWorker(ServerProcess):
    """A worker of this test process's, shared by its test files: ``holds`` is its hold folder
    (held_worker.py), ``audio`` its output folder; ``SHARED_FLAGS`` and ``flags``."""

    def __init__(self, tmp: Path, *flags: str) -> None:
        self.holds = tmp / "holds"
        self.audio = tmp / "tiny_audio"
        self.holds.mkdir(parents=True, exist_ok=True)
        port = free_port()
        args = [
            "tests/support/held_worker.py",
            "--worker-port",
            str(port),
            "--master-port",
            "0",
            "--output-dir",
            str(self.audio),
            *SHARED_FLAGS,
            *flags,
        ]
        env = {"SONGSERVE_HOLD_DIR": str(self.holds), "WORKER_TOKEN": ""}  # the tests send no token
        super().__init__(args, port, tmp / "tiny.log", env)

    def full_log(self) -> str:
        """The whole log since the worker started (``log_tail`` may have lost its start to older files' lines)."""
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def health(self) -> dict:
        return dict(httpx.get(self.url + "/health", timeout=10, verify=TLS).json())

    def reset(self) -> None:
        """As it was after start: no hold file, no take running, no KV snapshot, no cache fault counted."""
        for hold in self.holds.iterdir():
            hold.unlink(missing_ok=True)
        h = self.health()
        for task in {h.get("task_id"), *(t.get("task_id") for t in h.get("tasks") or [])} - {None}:
            httpx.post(f"{self.url}/cancel/{task}", timeout=10, verify=TLS)
        wait_for(lambda: self.health()["status"] == "idle", timeout=IDLE_WAIT, interval=0.2)
        self.signal(signal.SIGUSR1)

        def cleared() -> bool:
            kv = self.health()["kv_snapshots"]
            return kv["slots"] == [] and kv["faults"] == 0 and kv["restored_tokens"] == 0

        wait_for(cleared, timeout=60, interval=0.1)


def _shared(tmp: Path, *flags: str) -> Iterator[SharedWorker]:
    w = SharedWorker(tmp, *flags)
    try:
        w.wait_healthy(timeout=300)
        yield w
    finally:
        w.stop()


@pytest.fixture(scope="session")
def shared_tiny(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedWorker]:
    """This test process's tiny-model worker (``SHARED_FLAGS``), started on first use."""
    yield from _shared(tmp_path_factory.mktemp("shared_tiny"))


@pytest.fixture(scope="session")
def shared_release(release_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedWorker]:
    """This test process's worker on the release-shaped tiny set (``SHARED_FLAGS``), started on first use."""
    yield from _shared(tmp_path_factory.mktemp("shared_release"), "--checkpoints-dir", str(release_dir))


@contextmanager
def lent(worker: SharedWorker) -> Iterator[SharedWorker]:
    """The shared worker for a file that calls it directly: reset before and after."""
    worker.reset()
    try:
        yield worker
    finally:
        worker.reset()


@contextmanager
def tiny_site(
    worker: SharedWorker, tmp: Path, *api_args: str, more: tuple[ServerProcess, ...] = ()
) -> Iterator[Cluster]:
    """A dispatcher of its own (state in ``tmp``) over the shared worker, reset, and ``more`` workers (the
    caller's: started and stopped by it) after it in the pool's order; the worker is reset again after."""
    with lent(worker):
        c = cluster_of(tmp, [worker, *more], *api_args)
        try:
            yield c
        finally:
            c.api.stop()
