"""Helpers for tests that start real processes: free ports, a server process, polling."""

from __future__ import annotations

import errno
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from songserve.api.results.folder import PROBE_PREFIX
from tests.support import zygote
from tests.support.http import TLS

ROOT = Path(__file__).resolve().parents[2]


_HANDED_OUT: set[int] = set()
# 10000-10999 are the container proof's (scripts/test-containers), which CI runs beside the suite.
FIRST_TEST_PORT = 11_000


def _test_ports() -> range:
    """Where this test process picks ports: below the kernel's ephemeral range, which it hands to every
    outgoing connection at any moment (a port picked there, free when checked, was seen taken by some
    client's connection before the server bound it), and a slice of its own per xdist worker (two test
    processes never pick the same port)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32_768
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    span = (low - FIRST_TEST_PORT) // count
    index = int(worker) if worker.isdigit() else 0
    return range(FIRST_TEST_PORT + index * span, FIRST_TEST_PORT + (index + 1) * span)


def free_port() -> int:
    """A free port never handed out before in this test run, outside the ephemeral range (``_test_ports``):
    servers started one after another before any binds could otherwise be given the same port (seen:
    two workers on one port)."""
    ports = _test_ports()
    if len(ports) < 100:  # an ephemeral range that starts low: take the kernel's pick
        while True:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = int(s.getsockname()[1])
            if port not in _HANDED_OUT:
                _HANDED_OUT.add(port)
                return port
    while True:
        port = random.choice(ports)
        if port in _HANDED_OUT:
            continue
        _HANDED_OUT.add(port)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port


def poll_health(url: str, want: tuple[str, ...], timeout: float, exited: Callable[[], str | None]) -> dict:
    """Until ``url``'s ``/health`` answers 200 with a status in ``want`` (its body), through one kept
    connection (a client per poll costs a TLS context's CPU outside the test session); ``exited`` says
    why the server can no longer answer (then RuntimeError), or None."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2, verify=TLS) as http:
        while time.monotonic() < deadline:
            if why := exited():
                raise RuntimeError(why)
            try:
                r = http.get(url + "/health")
                if r.status_code == 200 and r.json().get("status") in want:
                    return dict(r.json())
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
    raise TimeoutError(f"{url} not healthy in {timeout}s")


class ServerProcess:
    """A real server process on a free port: started, polled on /health, stopped at the end.

    Our servers' scripts are forked from a template that has imported what they import
    (``tests/support/zygote.py``: 0.85 CPU-second less a dispatcher, 4 a tiny-model worker); ``fresh=True``
    starts a new interpreter, for what a cold start shows."""

    def __init__(
        self, args: list[str], port: int, log_path: Path, env: dict | None = None, fresh: bool = False
    ) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log = open(log_path, "ab")
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        kind = None if fresh else zygote.kind_of(args)
        self.proc: subprocess.Popen[bytes] | zygote.Forked
        if kind is not None:
            self.proc = zygote.spawn(kind, args, ROOT, full_env, log_path)
            return
        self.proc = subprocess.Popen(
            [sys.executable, *args],
            cwd=ROOT,
            env=full_env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_healthy(self, timeout: float = 120.0, want: tuple[str, ...] = ("idle", "ok")) -> dict:
        def exited() -> str | None:
            code = self.proc.poll()
            return None if code is None else f"server exited with {code}:\n{self.log_tail()}"

        try:
            return poll_health(self.url, want, timeout, exited)
        except TimeoutError:
            raise TimeoutError(f"{self.url} not healthy in {timeout}s:\n{self.log_tail()}") from None

    def log_tail(self, n: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-n:]

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self._log.close()
        return self.proc.returncode


def start_worker(
    tmp: Path,
    *extra: str,
    env: dict | None = None,
    name: str = "worker",
    script: str = "backend_worker.py",
    fresh: bool = False,
) -> ServerProcess:
    port = free_port()
    args = [
        script,
        "--worker-port",
        str(port),
        "--master-port",
        "0",
        "--output-dir",
        str(tmp / f"{name}_audio"),
        *extra,
    ]
    return ServerProcess(args, port, tmp / f"{name}.log", env, fresh)


def worker_refusal(*args: str, timeout: float = 120, fresh: bool = False) -> subprocess.CompletedProcess[str]:
    """Start a worker that must refuse to start (the timeout bounds how fast): its exit and output.

    Forked from the test process's template, as the servers are (a tiny-model worker's refusal: 4
    CPU-seconds of torch and megatron-core imports less); ``fresh=True`` starts a new interpreter, for
    a test that reads all of its stderr (a fork's import-time warnings went to its template's log)."""
    cmd = ["backend_worker.py", "--worker-port", "1", "--master-port", "0", *args]
    kind = None if fresh else zygote.kind_of(cmd)
    if kind is None:
        return subprocess.run([sys.executable, *cmd], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return zygote.run(kind, cmd, ROOT, timeout=timeout)


def results_files(root: Path, pattern: str = "*") -> list[Path]:
    """The files under a results folder that match ``pattern``, but for the folder's own writable probe
    (``PROBE_PREFIX``, which the dispatcher writes, syncs and removes at any moment: results/folder.py)."""
    return [p for p in root.rglob(pattern) if p.is_file() and not p.name.startswith(PROBE_PREFIX)]


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError("condition not met in time")


class Cluster:
    """Tone workers (or tiny-model workers) and a dispatcher, each a real process on a free port, or
    (``threads``) a server in a thread of the test process."""

    threads = False  # also for a Cluster made with __new__ over workers already started

    def __init__(
        self,
        tmp: Path,
        workers: int = 2,
        delay: float = 1.0,
        api_args: tuple[str, ...] = (),
        worker_args: tuple[str, ...] = (),
        threads: bool = False,
    ) -> None:
        """``threads``: the dispatcher and tone workers served in threads of the test process
        (tests/support/in_thread.py: the same apps on real sockets, no process start); for tests that need no
        process boundary (no signal, no kill, no log file)."""
        from tests.support import in_thread  # it imports this module

        self.tmp = tmp
        self.api_args = api_args
        self.threads = threads
        flags = worker_args or ("--pipeline", "test", "--test-delay-s", str(delay))
        self.workers: list[Any] = [
            in_thread.tone_worker(tmp, *flags, name=f"worker{i}")
            if threads
            else start_worker(tmp, *flags, name=f"worker{i}")
            for i in range(workers)
        ]
        for w in self.workers:
            w.wait_healthy()
        self.api: Any = None
        self.start_api()

    def start_api(self, *extra: str) -> Any:
        if self.threads:
            from tests.support import in_thread

            if self.api is not None:
                self.api.stop()
            self.api = in_thread.dispatcher(self.tmp, [w.url for w in self.workers], *self.api_args, *extra)
            return self._ready(self.api_args + extra)
        port = self.api.port if self.api else free_port()
        if self.api is not None:
            self.api.stop()  # a dispatcher killed by a test: close its log before the next one opens it
        urls = ",".join(w.url for w in self.workers)
        args = [
            "backend_api.py",
            "--port",
            str(port),
            "--state-dir",
            str(self.tmp / "state"),
            "--health-interval",
            "0.2",
            *(("--worker-urls", urls) if urls else ("--num-workers", "0")),
            *self.api_args,
            *extra,
        ]
        self.api = ServerProcess(args, port, self.tmp / "api.log")
        return self._ready(tuple(args))

    def _ready(self, args: tuple[str, ...]) -> Any:
        """Until the dispatcher answers and counts every worker idle."""
        self.api.wait_healthy(want=("ok",))
        key = args[args.index("--api-key") + 1] if "--api-key" in args else None
        if key is None and "--api-keys-file" in args:  # any of the file's keys may read /status
            key = next(iter(json.loads(Path(args[args.index("--api-keys-file") + 1]).read_text())), None)
        auth = {"Authorization": f"Bearer {key}"} if key else {}
        url = self.api.url + "/status"
        wait_for(lambda: httpx.get(url, headers=auth, verify=TLS).json()["idle_gpus"] == len(self.workers), timeout=30)
        return self.api

    @property
    def url(self) -> str:
        assert self.api is not None
        return self.api.url

    def submit(self, **body) -> dict:
        payload = {"lyrics": "hello\nworld", "tags": "pop", "duration": 0.05, **body}
        r = httpx.post(self.url + "/generate", json=payload, timeout=10, verify=TLS)
        assert r.status_code == 200, r.text
        return r.json()

    def job(self, job_id: str, headers: dict[str, str] | None = None) -> dict:
        """``GET /job/{id}`` (``headers``: a key's ``Authorization`` behind ``API_KEY``)."""
        return httpx.get(f"{self.url}/job/{job_id}", headers=headers, timeout=10, verify=TLS).json()

    def wait_job(self, job_id: str, timeout: float = 60.0, headers: dict[str, str] | None = None) -> dict:
        terminal = {"completed", "partial", "failed", "cancelled"}
        return wait_for(
            lambda: (j := self.job(job_id, headers)) and j.get("status") in terminal and j,
            timeout=timeout,
            interval=0.1,
        )

    def stop(self) -> None:
        for p in [self.api, *self.workers]:
            if p:
                p.stop()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_launched(proc: subprocess.Popen, api: str, out: Path, timeout: float = 240) -> None:
    """Until a launcher's dispatcher at ``api`` is ready; fails with the launcher's output if it exits first."""

    def ready() -> bool:
        assert proc.poll() is None, out.read_text()
        try:
            return httpx.get(api + "/ready", timeout=2, verify=TLS).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(ready, timeout=timeout, interval=0.5)


def start_reference_worker(
    tmp: Path, name: str = "reference", delay: float = 1.0, hold_file: Path | None = None
) -> ServerProcess:
    """The reference worker's stand-in (tests/support/reference_worker.py), its requests logged as JSON lines;
    ``hold_file``: its takes wait in the backbone while that file exists."""
    port = free_port()
    args = [
        "tests/support/reference_worker.py",
        "--worker-port",
        str(port),
        "--output-dir",
        str(tmp / f"{name}_audio"),
        "--delay-s",
        str(delay),
        "--requests-log",
        str(tmp / f"{name}_requests.jsonl"),
        *(("--hold-file", str(hold_file)) if hold_file else ()),
    ]
    return ServerProcess(args, port, tmp / f"{name}.log")


def start_bad_worker(tmp: Path, mode: str, name: str = "bad", *extra: str) -> ServerProcess:
    """Our worker with a fault on command (tests/support/bad_worker.py: garbage answers, drips, oversize or cut files)."""
    port = free_port()
    args = [
        "tests/support/bad_worker.py",
        "--mode",
        mode,
        "--worker-port",
        str(port),
        "--master-port",
        "0",
        "--output-dir",
        str(tmp / f"{name}_audio"),
        *extra,
    ]
    return ServerProcess(args, port, tmp / f"{name}.log")


def bad_worker_state(w: ServerProcess) -> dict:
    """What the stand-in saw: its mode, ``task_calls`` and how long each drip or oversize download lasted."""
    return httpx.get(w.url + "/misbehave", timeout=10, verify=TLS).json()


def cluster_of(tmp: Path, workers: list[ServerProcess], *api_args: str) -> Cluster:
    """A dispatcher over workers that are already started (any kind)."""
    for w in workers:
        w.wait_healthy()
    c = Cluster.__new__(Cluster)
    c.tmp, c.api_args, c.workers, c.api = tmp, api_args, workers, None
    c.start_api()
    return c


def mount_tmpfs(where: Path, size: str) -> str | None:
    """Mount a small tmpfs at ``where``; returns why it cannot be done, or None (unmount with umount)."""
    if os.name != "posix" or os.geteuid() != 0:
        return "needs root on Linux to mount a tmpfs"
    where.mkdir(parents=True, exist_ok=True)
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    return None if out.returncode == 0 else f"mount not allowed here: {out.stderr.decode(errors='replace').strip()}"


def fill_disk(folder: Path, leave_bytes: int = 0) -> Path:
    """Fill the file system of ``folder`` up to ``leave_bytes`` of free space; returns the filler file.

    A server may write there at the same time: the disk filling up before the filler is whole is the
    state asked for (then the filler gives ``leave_bytes`` back)."""
    st = os.statvfs(folder)
    filler = folder / "filler"
    want = max(0, st.f_bavail * st.f_frsize - leave_bytes)
    with open(filler, "wb") as f:
        try:
            f.write(b"\0" * want)
            return filler
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
    written = filler.stat().st_size
    os.truncate(filler, max(0, written - leave_bytes))
    return filler


def faults_charged(c: Cluster, worker_id: int) -> float:
    text = httpx.get(c.url + "/metrics", timeout=10, verify=TLS).text
    found = re.search(rf'songserve_worker_faults_total{{worker="{worker_id}"}} ([0-9.]+)', text)
    return float(found.group(1)) if found else 0.0
