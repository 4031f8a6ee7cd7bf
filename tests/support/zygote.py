"""Server processes forked from a template that has already imported what they import.

Why: the suite starts about 250 servers (dispatchers, tone workers, tiny-model workers), and CI runs
it on two cores. Measured to healthy, a fresh dispatcher takes 1.0 CPU-second (0.15 forked), a tone
worker 0.75 (0.1), a tiny-model worker 4.8 (0.6): the rest is importing FastAPI, pydantic, the package,
torch and megatron-core. A template (one per kind, per test process, started on first use) imports that once
and forks a server per request: the server is still a process of its own (its pid, its session, its
signals, kill -9, its exit status, its memory, its log file), runs its script's ``__main__`` with its
own argv, environment and working folder, and imports the rest itself.

What it is not: a fresh interpreter. What ran at import ran once, in the template, with the test
process's environment; the template's warnings went to its own log. ``/proc/PID/cmdline`` and
``/proc/PID/environ`` show the template's (the server's own environment is ``os.environ``): tests
that find processes by those (``tests/support/procs.py``) start them fresh. Tests about a cold start (the
launcher, start-up noise, a missing package) start real ``python`` processes: ``ServerProcess(...,
fresh=True)``, and the launcher's tests run ``run_backend.sh`` itself. ``SONGSERVE_TEST_FORK=0``
starts every server fresh.

The same template runs short commands too: ``run`` is ``subprocess.run`` for ``python -m MODULE
...`` (the benchmarks' smoke runs), with its stdout and stderr apart.

The protocol, one connection per server on a Unix socket: the client sends one JSON line (argv, env,
cwd, log path, and a second path for stderr where it is kept apart), the template forks and answers
``pid N``, and, when the server exits, ``exit CODE`` (``os.waitstatus_to_exitcode``: minus the
signal's number for a signal, as ``subprocess``). An argv that starts with ``-m`` runs that module
as ``python -m`` does.

    python tests/support/zygote.py KIND SOCKET      a template (started by ``spawn``, not by hand)
"""

from __future__ import annotations

import importlib
import json
import os
import random
import runpy
import select
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

# What each kind imports before it forks: what the server would otherwise import at its start,
# including what its ``main`` imports late (the app, uvicorn and the protocol and loop uvicorn picks).
SERVING = (
    "uvicorn",
    "uvicorn.protocols.http.h11_impl",
    "uvicorn.lifespan.on",
    "uvicorn.loops.auto",
    "songserve.http.serving",
)
WORKER = ("songserve.worker.main", "songserve.worker.runtime", "songserve.worker.app", *SERVING)
PRELOAD: dict[str, tuple[str, ...]] = {
    "api": ("songserve.api.main", "songserve.api.http.app", "songserve.api.acestep.app", *SERVING),
    "worker": (*WORKER, "songserve.worker.device", "songserve.pipeline.testing.tone", "soundfile"),
    "torch": (
        *WORKER,
        "torch",
        "megatron.core",
        "songserve.pipeline.checkpoints.layout",
        "songserve.pipeline.checkpoints.megatron_env",
        "songserve.pipeline.pipeline",
        "songserve.worker.torch_device",
    ),
}
# Where a test process's templates listen, for the processes it starts (SONGSERVE_TEST_TEMPLATE_TORCH, ...).
ENV_SOCKET = "SONGSERVE_TEST_TEMPLATE_"
# Scripts whose servers are forked, and from which template; any other script starts fresh.
TONE_SCRIPTS = {"tests/support/bad_worker.py", "tests/support/late_worker.py", "tests/support/reference_worker.py"}


def kind_of(args: list[str]) -> str | None:
    """The template for ``python *args``, or None for a fresh process."""
    if os.environ.get("SONGSERVE_TEST_FORK", "1") == "0" or not args:
        return None
    script = args[0]
    if script == "backend_api.py":
        return "api"
    if script == "backend_worker.py":
        pipeline = args[args.index("--pipeline") + 1] if "--pipeline" in args[:-1] else None
        return "worker" if pipeline == "test" else "torch"
    if script in TONE_SCRIPTS:
        return "worker"
    if script == "tests/support/held_worker.py":  # our model worker with hold points (tests/support/tiny_site.py)
        return "torch"
    return None


# ---- the client (the test process) -------------------------------------------------------------


class Forked:
    """A server forked by a template, with the part of ``subprocess.Popen`` the tests use."""

    def __init__(self, conn: socket.socket, pid: int, args: list[str]) -> None:
        self.pid, self.args, self.returncode = pid, args, None
        self._conn = conn
        self._lock = threading.Lock()

    def _read_exit(self, timeout: float | None) -> None:
        with self._lock:
            if self.returncode is not None:
                return
            ready, _, _ = select.select([self._conn], [], [], timeout)
            if not ready:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self._conn.settimeout(10)  # the line is there, or the template is gone
            line = self._conn.makefile("r").readline()
            if not line.startswith("exit "):
                raise RuntimeError(f"the template of pid {self.pid} went away without its exit status ({line!r})")
            self.returncode = int(line.split()[1])
            self._conn.close()

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self._read_exit(0)
            except subprocess.TimeoutExpired:
                pass
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._read_exit(timeout)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __del__(self) -> None:  # a server nobody waited for: its exit status is not wanted
        self._conn.close()


class Template:
    """One template process of a kind, started by this test process (or, ``borrowed``, by the test
    process this one was forked for: a benchmark's smoke run asks its parent's template for its workers)."""

    def __init__(self, kind: str, log: Path, borrowed: Path | None = None) -> None:
        self.kind = kind
        self.proc: subprocess.Popen[bytes] | None = None
        if borrowed is not None:
            self.path = borrowed
            return
        self.path = Path(tempfile.mkdtemp(prefix="zygote-")) / "sock"
        self._log = open(log, "ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__)), kind, str(self.path)],
            cwd=Path(__file__).parents[2],
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 300
        while not self.path.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"the {kind} template exited with {self.proc.returncode}: see {log}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {kind} template did not start in 300 s: see {log}")
            time.sleep(0.02)
        os.environ[f"{ENV_SOCKET}{kind.upper()}"] = str(self.path)  # for the processes this one starts

    def spawn(self, args: list[str], cwd: Path, env: dict[str, str], log: Path, err: Path | None = None) -> Forked:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(str(self.path))
        request = {"argv": args, "cwd": str(cwd), "env": env, "log": str(log), "err": str(err or log)}
        conn.sendall(json.dumps(request).encode() + b"\n")
        conn.settimeout(60)
        reply = b""
        while not reply.endswith(b"\n"):
            chunk = conn.recv(1)
            if not chunk:
                raise RuntimeError(f"the {self.kind} template closed the connection: see its log")
            reply += chunk
        word, pid = reply.decode().split()
        assert word == "pid", reply
        return Forked(conn, int(pid), args)

    def alive(self) -> bool:
        return self.path.exists() if self.proc is None else self.proc.poll() is None

    def stop(self) -> None:
        """The template only (not a borrowed one): its servers are their tests' to stop."""
        if self.proc is None:
            return
        os.environ.pop(f"{ENV_SOCKET}{self.kind.upper()}", None)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        self.path.unlink(missing_ok=True)
        self.path.parent.rmdir()


_templates: dict[str, Template] = {}
_start = threading.Lock()


def spawn(kind: str, args: list[str], cwd: Path, env: dict[str, str], log: Path, err: Path | None = None) -> Forked:
    """``python *args`` forked from this test process's template of ``kind`` (started on first use;
    its log sits next to the first server's); stdout to ``log``, stderr there too unless ``err``."""
    with _start:
        t = _templates.get(kind)
        if t is None or not t.alive():
            lent = os.environ.get(f"{ENV_SOCKET}{kind.upper()}")
            if lent and Path(lent).exists():
                t = Template(kind, log, borrowed=Path(lent))
            else:
                t = Template(kind, log.parent / f"template-{kind}.log")
            _templates[kind] = t
    return t.spawn(args, cwd, env, log, err)


def run(
    kind: str, args: list[str], cwd: Path, timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([python, *args], capture_output=True, text=True)``, forked from the template of
    ``kind``, or a fresh ``python`` where forks are off (``SONGSERVE_TEST_FORK=0``)."""
    env = dict(os.environ if env is None else env)
    if os.environ.get("SONGSERVE_TEST_FORK", "1") == "0":
        return subprocess.run(
            [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
        )
    tmp = Path(tempfile.mkdtemp(prefix="zygote-run-"))  # kept while a template started here logs in it
    out, err = tmp / "stdout", tmp / "stderr"
    proc = spawn(kind, args, cwd, env, out, err)
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        raise
    done = subprocess.CompletedProcess(
        [sys.executable, *args], code, out.read_text(errors="replace"), err.read_text(errors="replace")
    )
    out.unlink()
    err.unlink()
    if not any(tmp.iterdir()):
        tmp.rmdir()
    return done


def stop_all() -> None:
    """At the end of the test process (tests/conftest.py)."""
    with _start:
        for t in _templates.values():
            t.stop()
        _templates.clear()


# ---- the template ------------------------------------------------------------------------------


def _serve(kind: str, path: Path) -> None:
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # as ``python backend_api.py`` run from the root sees it
    for name in PRELOAD[kind]:
        importlib.import_module(name)
    parent = os.getppid()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the loop through the pipe
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path) + ".new")
    listener.listen(64)
    os.rename(str(path) + ".new", path)  # the client waits for the name: it exists once it accepts
    print(f"template {kind}: ready, pid {os.getpid()}", flush=True)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    servers: dict[int, socket.socket] = {}
    while os.getppid() == parent:
        for key, _ in sel.select(timeout=1.0):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                conn.settimeout(30)
                request = json.loads(conn.makefile("rb").readline())
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    for other in (listener, *servers.values()):
                        other.close()
                    _become(request, conn, wake_r, wake_w)  # returns only by raising SystemExit
                servers[pid] = conn
                conn.sendall(f"pid {pid}\n".encode())
            else:
                os.read(wake_r, 4096)
        while servers:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = servers.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass  # the test let go of it
                conn.close()
    path.unlink(missing_ok=True)


def _become(request: dict[str, Any], conn: socket.socket, wake_r: int, wake_w: int) -> None:
    """In the forked child: the server's own session, stdio, folder, environment and argv; then its
    script as ``__main__``. Its exit (a return, ``sys.exit`` or an exception) is the interpreter's."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    conn.close()
    os.close(wake_r)
    os.close(wake_w)
    os.setsid()
    for fd, path in ((1, request["log"]), (2, request.get("err") or request["log"])):
        f = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(f, fd)
        os.close(f)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    random.seed()  # the template's state would repeat in every server
    argv = list(request["argv"])
    if argv[0] == "-m":  # as ``python -m MODULE``: the working folder first on the path
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path[0] = str(Path(argv[0]).resolve().parent)
        runpy.run_path(argv[0], run_name="__main__")
    sys.exit(0)


if __name__ == "__main__":
    _serve(sys.argv[1], Path(sys.argv[2]))
