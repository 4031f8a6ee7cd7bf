"""Dispatchers and tone workers served by uvicorn in threads of the test process.

The same apps the programs serve (``create_app`` of each), on real sockets with real HTTP and
streaming, built from the same flags through the same settings loader, but without a process start
per server: a process costs a second or two of imports on the CI machine's two cores, and most
tests start three. What needs a process boundary (signals, ``kill -9``, a full disk, a process's
memory, the launcher, log files) keeps ``tests/support/servers.py``'s ``ServerProcess``.

Each server binds its socket before its settings are made, so no other process can take the port
between picking it and binding it. A server stops the way a process's uvicorn stops on its first
signal, less the drain: the app's lifespan ends (the dispatcher closes its store, the worker its
model thread), then the thread is joined.
"""

from __future__ import annotations

import logging
import socket
import threading
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi import routing as fastapi_routing

from songserve.http.serving import header_timeout_protocol
from songserve.process.logs import LineFormatter
from tests.support.servers import poll_health, wait_for

START_TIMEOUT_SEC = 60.0
_BUILDING = threading.Lock()


def build_routes(app: Any) -> None:
    """Build every route of ``app`` now, one app of this process at a time.

    FastAPI builds an included router's routes (their parameters' pydantic schemas) on the first
    request that reaches them, and pydantic's schema building is not thread-safe. A program serves
    its apps on one event loop, so it never builds two at once; servers in threads of this process
    do, and share the endpoints' types: two workers' first ``/generate`` at the same moment were seen
    to fail one with a 500 (``AttributeError: __pydantic_core_schema__``). Walked here as a request
    that matches nothing walks them; ``ByPort``'s apps (the ACE-Step port) included."""
    included = getattr(fastapi_routing, "_IncludedRouter", None)
    if included is None:  # a FastAPI that builds routes when they are included
        return

    def walk(routes: list[Any]) -> None:
        for route in routes:
            if isinstance(route, included):
                route.effective_low_priority_routes()
                walk(route.effective_candidates())

    apps = [app, *getattr(app, "by_port", {}).values(), getattr(app, "main", None)]
    with _BUILDING:
        for each in apps:
            if isinstance(each, FastAPI) and isinstance(each.router, fastapi_routing.APIRouter):
                walk(each.router.routes)


def bound_socket(port: int = 0) -> socket.socket:
    """A listening socket on ``port``, or on one the kernel picked: the port is ours from here on."""
    # IPPROTO_TCP, as the programs' sockets (api/acestep/app.py): asyncio sets TCP_NODELAY only then,
    # and without it each small answer waits ~40 ms for a delayed ACK.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(2048)
    return sock


class LogFile:
    """The lines of ``loggers`` in a file, formatted as the program's process writes them (at INFO)."""

    def __init__(self, path: Path, program: str, loggers: tuple[str, ...]) -> None:
        self.path = path
        self._handler = logging.FileHandler(path, encoding="utf-8")
        self._handler.setFormatter(LineFormatter(f"%(asctime)s %(levelname)s {program} %(name)s: %(message)s"))
        self._loggers = [logging.getLogger(name) for name in loggers]
        self._levels = [logger.level for logger in self._loggers]
        for logger in self._loggers:
            logger.addHandler(self._handler)
            logger.setLevel(logging.INFO)

    def close(self) -> None:
        for logger, level in zip(self._loggers, self._levels, strict=True):
            logger.removeHandler(self._handler)
            logger.setLevel(level)
        self._handler.close()


class ThreadServer:
    """An ASGI app under uvicorn in a daemon thread, on sockets bound by the caller.

    ``log``: the server's lines in a file (``log_path``, ``log_tail``) where they can be told apart from
    other servers' in this process: a dispatcher's, by their logger (one dispatcher at a time). Workers
    in threads share their loggers, so theirs are not kept apart: a test that reads a worker's log
    starts it as a process."""

    def __init__(
        self,
        app: Any,
        sockets: list[socket.socket],
        name: str,
        header_timeout: float = 10.0,
        log: LogFile | None = None,
    ) -> None:
        self.name = name
        self._log = log
        self.log_path = log.path if log else None
        self.port = int(sockets[0].getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._sockets = sockets
        build_routes(app)
        config = uvicorn.Config(
            app, log_level="warning", timeout_graceful_shutdown=2, http=header_timeout_protocol(header_timeout)
        )
        self._server = uvicorn.Server(config)
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"server-{name}", daemon=True)
        self._thread.start()
        wait_for(lambda: self._server.started or self._failed or not self._thread.is_alive(), START_TIMEOUT_SEC)
        if not self._server.started:
            raise RuntimeError(f"{name} did not start: {self._failed!r}")

    def _run(self) -> None:
        try:
            self._server.run(sockets=self._sockets)
        except BaseException as exc:  # reported by the constructor, or by stop()
            self._failed = exc

    def wait_healthy(self, timeout: float = 60.0, want: tuple[str, ...] = ("idle", "ok")) -> dict[str, Any]:
        return poll_health(self.url, want, timeout, lambda: None if self.running else f"{self.name} stopped")

    def log_tail(self, n: int = 4000) -> str:
        assert self.log_path is not None, f"{self.name}: a worker in a thread keeps no log of its own"
        return self.log_path.read_text(errors="replace")[-n:]

    def stop(self, timeout: float = 15.0) -> None:
        if self._thread.is_alive():
            self._server.should_exit = True
            self._thread.join(timeout)
        assert not self._thread.is_alive(), f"{self.name} did not stop in {timeout}s"
        for sock in self._sockets:
            sock.close()
        if self._log is not None:
            self._log.close()
            self._log = None

    @property
    def running(self) -> bool:
        return self._thread.is_alive()


def tone_worker(tmp: Path, *flags: str, name: str = "worker") -> ThreadServer:
    """Our worker with the test pipeline (a tone, numpy on the CPU), from the worker's own flags."""
    from songserve.process.settings import load_settings
    from songserve.worker.app import create_app
    from songserve.worker.main import build_runtime
    from songserve.worker.settings import WorkerSettings

    sock = bound_socket()
    port = sock.getsockname()[1]
    args = ["--worker-port", str(port), "--master-port", "0", "--output-dir", str(tmp / f"{name}_audio")]
    s = load_settings(WorkerSettings, [*args, *(flags or ("--pipeline", "test"))])
    assert s.pipeline == "test", "in a thread: only the tone pipeline (a model worker is a process of its own)"
    runtime = build_runtime(s)
    return ThreadServer(create_app(runtime), [sock], name, s.header_timeout_sec)


def dispatcher(tmp: Path, worker_urls: list[str], *flags: str, name: str = "api") -> ThreadServer:
    """Our dispatcher over ``worker_urls`` with its store in ``tmp/state``, from the dispatcher's own flags:
    ``main``'s checks (``compose.check``: a bad setting raises its ``ConfigError``), its app and its
    ACE-Step port, served in a thread."""
    from songserve.api.acestep.app import with_acestep
    from songserve.api.compose import check
    from songserve.api.http.app import create_app
    from songserve.api.settings import DispatcherSettings
    from songserve.process.settings import load_settings

    sock = bound_socket()
    port = sock.getsockname()[1]
    workers = ("--worker-urls", ",".join(worker_urls)) if worker_urls else ("--num-workers", "0")
    # No drain on stop (a process is killed 10 s into its drain by ServerProcess.stop): flags may ask for one.
    args = [
        "--port",
        str(port),
        "--state-dir",
        str(tmp / "state"),
        "--health-interval",
        "0.2",
        "--drain-timeout-sec",
        "0",
        *workers,
        *flags,
    ]
    s = load_settings(DispatcherSettings, args)
    try:
        app = create_app(check(s))
    except BaseException:
        sock.close()
        raise
    sockets = [sock]
    if s.acestep_port is not None:  # ACE-Step's dialect on a second port, as main serves it
        sockets.append(bound_socket(s.acestep_port))
    log = LogFile(tmp / f"{name}.log", "api", ("songserve.api",))
    return ThreadServer(with_acestep(s, app), sockets, name, s.header_timeout_sec, log)
