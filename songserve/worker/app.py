"""The worker's application: its lifespan, its guards and its routers (``routes.py``) over ``WorkerRuntime``.

``/health``, ``/config``, ``/generate``, ``/generate_batch``, ``/encode``, ``/tasks`` and ``/cancel``
answer models of ``songserve.schemas`` (``/tasks/{id}/stream``: a running take's live audio), serialised
by FastAPI. Errors take the one error body (``http/errors.py``). ``/encode`` takes an audio file as its
raw body, up to ``MAX_AUDIO_MB`` (every other body: ``MAX_BODY_BYTES``), read from memory: nothing of
it is written on the worker. The bearer token (``WORKER_TOKEN``) is checked before any body is read.

The lifespan loads the models on the model thread (``/health`` answers meanwhile), sweeps output
files past ``OUTPUT_TTL_SEC`` in the background (the dispatcher removes each task's files with
``DELETE /files/{task_id}`` once it has copied them) and announces the worker where ``ANNOUNCE`` says.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI

from songserve import __version__
from songserve.http.errors import install_error_handlers
from songserve.http.guard import BearerAuth, BodyLimit
from songserve.worker.announce import Announcer
from songserve.worker.fence import LeaseFences
from songserve.worker.routes import ROUTERS, adapter_limit, audio_limit, not_the_api
from songserve.worker.runtime import WorkerRuntime
from songserve.worker.settings import WorkerSettings
from songserve.worker.urls import dispatcher_urls, local_health_url

log = logging.getLogger(__name__)


def sweep_interval(ttl_sec: float) -> float:
    """How often to sweep: often enough for the TTL to hold within ~10 %, never busier than once a second."""
    return min(max(ttl_sec / 10, 1.0), 600.0)


async def sweep_loop(runtime: WorkerRuntime) -> None:
    """Remove old output files forever; one failed sweep is logged and the next one runs."""
    interval = sweep_interval(runtime.s.output_ttl_sec)
    while True:
        await asyncio.sleep(interval)
        try:
            await asyncio.to_thread(runtime.sweep_outputs)
        except Exception:
            log.exception("output sweep failed; retrying in %.0fs", interval)


def make_announcer(s: WorkerSettings) -> Announcer | None:
    """The announcer for ``ANNOUNCE`` (settings already checked the URLs and the token), or None."""
    if not s.announce:
        return None
    return Announcer(
        dispatcher_urls(s.announce),
        public_url=s.public_url,
        token=s.worker_token,
        interval_sec=s.announce_interval_sec,
        health_url=local_health_url(s.host, s.worker_port),
    )


def create_app(runtime: WorkerRuntime, on_load_failure: Callable[[Exception], None] | None = None) -> FastAPI:
    """The worker's app over ``runtime``: the routes' dependencies live in its state, set here once."""
    announcer = make_announcer(runtime.s)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async def load() -> None:
            try:
                await runtime.start()
            except Exception as exc:
                if on_load_failure:
                    on_load_failure(exc)

        task = asyncio.create_task(load())
        sweeper = asyncio.create_task(sweep_loop(runtime)) if runtime.s.output_ttl_sec > 0 else None
        if announcer is not None:
            announcer.start()  # waits for our own /health to answer, then registers with each dispatcher
        yield
        if announcer is not None:
            await announcer.stop()  # after the drain: leave where joined, so no dispatcher waits for the TTL
        task.cancel()
        if sweeper is not None:
            sweeper.cancel()
        runtime.shutdown()

    app = FastAPI(title="songserve worker", version=__version__, lifespan=lifespan)
    app.state.runtime = runtime
    app.state.fences = LeaseFences()  # a task from a dispatcher whose lease here passed on is refused (fence.py)
    app.state.announcer = announcer
    install_error_handlers(app)
    limits = {"/encode": audio_limit(runtime.s), "/adapters/": adapter_limit(runtime.s)}
    app.add_middleware(BodyLimit, max_bytes=runtime.s.max_body_bytes, paths=limits)
    if runtime.s.worker_token:  # outside the body limit: no body is read before the token is checked
        app.add_middleware(
            BearerAuth,
            token=runtime.s.worker_token,
            exempt={"/health", "/"},
            realm="songserve-worker",
            refusal=not_the_api(runtime.s),
        )
    for router in ROUTERS:
        app.include_router(router)
    return app
