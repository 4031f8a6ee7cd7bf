"""The dialect's app and its port: a second listening socket of the same dispatcher process.

``serving_plan`` is what ``backend_api.py`` calls: without ``ACESTEP_PORT`` it hands back our app
and no sockets, so nothing changes; with it, both ports are bound here (a port in use refuses
start-up in one line naming the setting) and one uvicorn server serves both through ``ByPort``,
which sends each connection to the app of the port it came in on. One server means one event loop,
one lifespan (our app's: ``compose.build``, the parts the dialect's routes use), one drain on SIGTERM and the
same header timeout on both ports.

CORS is our port's (``CORS_ORIGINS`` and any localhost origin), so ACE-Step's Studio page served
from a local origin can call it; ACE-Step itself sends none at f30aee4c, which leaves its own page
unable to talk to it. Auth is the dialect's (``auth.py``), with our ``API_KEY``.
"""

from __future__ import annotations

import socket

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from songserve import __version__
from songserve.api.acestep.failures import install_error_handlers
from songserve.api.acestep.lora import LoraSessions
from songserve.api.acestep.routes import router
from songserve.api.acestep.stats import JobTally
from songserve.api.http.app import LOCAL_ORIGINS, cors_origins
from songserve.api.settings import DispatcherSettings
from songserve.errors import ConfigError


def create_acestep_app(s: DispatcherSettings, host: FastAPI) -> FastAPI:
    """ACE-Step's routes over ``host``'s parts (``host.state.parts``, set by its lifespan)."""
    app = FastAPI(
        title="songserve: ACE-Step 1.5's API",
        version=__version__,
        description="ACE-Step's REST dialect over the songserve dispatcher: a task is a job.",
    )
    app.state.host = host
    app.state.settings = s
    app.state.tally = JobTally()
    app.state.lora = LoraSessions()  # each key's /v1/lora/* choice for its later tasks
    install_error_handlers(app)
    app.add_middleware(
        CORSMiddleware,
        allow_origins=cors_origins(s),
        allow_origin_regex=LOCAL_ORIGINS,
        allow_methods=["GET", "POST", "HEAD"],
        allow_headers=["Authorization", "Content-Type", "Range"],
    )
    app.include_router(router)
    return app


class ByPort:
    """Each HTTP connection to the app of its local port; lifespan and the rest to the main app."""

    def __init__(self, main: ASGIApp, by_port: dict[int, ASGIApp]) -> None:
        self.main = main
        self.by_port = by_port

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        server = scope.get("server") if scope["type"] in ("http", "websocket") else None
        app = self.by_port.get(server[1], self.main) if server else self.main
        await app(scope, receive, send)


def listen(host: str, port: int, setting: str) -> socket.socket:
    """A bound TCP socket (uvicorn listens on it), or a ConfigError naming the setting."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are TCP, and
    # without it every small answer waits ~40 ms for a delayed ACK (measured: 1.5 → 47 ms a request).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"Setting {setting}: cannot listen on {host}:{port} ({exc.strerror or exc}).") from None
    return sock


def with_acestep(s: DispatcherSettings, app: FastAPI) -> ASGIApp:
    """Our app, and with ``ACESTEP_PORT`` ACE-Step's on that port of the same server (``ByPort``)."""
    if s.acestep_port is None:
        return app
    return ByPort(app, {s.acestep_port: create_acestep_app(s, app)})


def serving_plan(s: DispatcherSettings, app: FastAPI) -> tuple[ASGIApp, list[socket.socket] | None]:
    """The app to serve and the sockets to serve it on (None: uvicorn binds ``API_PORT`` itself)."""
    if s.acestep_port is None:
        return app, None
    sockets = [listen(s.host, s.port, "API_PORT")]
    try:
        sockets.append(listen(s.host, s.acestep_port, "ACESTEP_PORT"))
    except ConfigError:
        sockets[0].close()
        raise
    return with_acestep(s, app), sockets
