"""The dispatcher's application: the service's lifespan, middleware, routes and the page."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.routing import Route

from songserve import __version__
from songserve.api.http.api_docs import docs_router
from songserve.api.http.page import FILES, page_router
from songserve.api.http.routes import router
from songserve.api.http.tags import TAGS, load_catalogue
from songserve.api.mcp.server import McpServer, body_limit, too_large
from songserve.api.results.artifacts import ArtifactStore
from songserve.api.service.job_service import JobService
from songserve.api.service.keys import ApiKeys, KeyAuth
from songserve.api.service.uploads import upload_limit
from songserve.api.settings import DispatcherSettings
from songserve.api.store.protocol import JobStore
from songserve.api.store.sqlite.store import SqliteStore
from songserve.api.workers.client import WorkerHttp
from songserve.http.errors import install_error_handlers
from songserve.http.guard import BodyLimit
from songserve.http.keepalive import CLIENT_KEEPALIVE_SEC

PAGE = {*FILES, "/tags"}
LOCAL_ORIGINS = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?"  # any port of this machine


def cors_origins(s: DispatcherSettings) -> list[str]:
    """``CORS_ORIGINS``: origins allowed besides the local ones (both dialects' ports)."""
    return [o.strip() for o in s.cors_origins.split(",") if o.strip()]


async def open_store(s: DispatcherSettings) -> JobStore:
    """The store the settings name: PostgreSQL when ``STORE_URL`` is set, else SQLite in the state folder."""
    if s.store_url:
        from songserve.api.store.postgres.conn import StoreLimits
        from songserve.api.store.postgres.store import PgStore  # psycopg is needed only here

        limits = StoreLimits(s.store_statement_timeout_sec, s.store_lock_timeout_sec)
        return await PgStore.open(s.store_url, s.my_id(), s.store_pool_size, limits=limits)
    return SqliteStore(s.state_dir / "jobs.sqlite3")


DESCRIPTION = (
    "Song generation dispatcher: jobs of tracks over a pool of GPU workers. Assistants call it as an MCP server at "
    "/mcp (Streamable HTTP, the same API keys as bearer tokens; docs/mcp.md)."
)


def create_app(s: DispatcherSettings) -> FastAPI:
    keys = ApiKeys.load(s.api_key, s.api_keys_file)  # a bad keys file refuses start-up (main.py reads it first)
    mcp = McpServer(s, lambda: app.state.service, lambda: app.state.tags)  # /mcp: the tools over the same service

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        headers = {"Authorization": f"Bearer {s.worker_token}"} if s.worker_token else {}
        async with WorkerHttp.open(headers, s.live_listeners_max, CLIENT_KEEPALIVE_SEC) as http:
            store = await open_store(s)
            app.state.tags = load_catalogue(s.tags_file) if s.tags_file else TAGS
            app.state.service = svc = JobService(s, store, ArtifactStore(s.results_path()), http)
            watch = asyncio.create_task(keys.watch()) if s.api_keys_file else None  # keys change without a restart
            try:
                await svc.start()
                async with mcp.running():
                    yield
            finally:
                if watch is not None:
                    watch.cancel()
                await svc.drain(s.drain_timeout_sec)
                await svc.stop()
                await store.close()

    app = FastAPI(
        title="songserve",
        version=__version__,
        lifespan=lifespan,
        description=DESCRIPTION,
        docs_url=None,  # /docs and /redoc: http/api_docs.py, from a package's files, not a CDN (they work offline)
        redoc_url=None,
    )
    install_error_handlers(app)
    app.add_middleware(
        CORSMiddleware,
        allow_origins=cors_origins(s),
        allow_origin_regex=LOCAL_ORIGINS,
        allow_methods=["GET", "POST", "DELETE"],
        allow_headers=["Authorization", "Content-Type", "Idempotency-Key", "Prefer", "Range"],
        expose_headers=["Preference-Applied", "Retry-After"],
    )
    app.state.keys = keys  # the ACE-Step dialect checks the same keys
    # The body limit inside the key check: a caller without a key gets its 401 before a byte is read.
    app.add_middleware(
        BodyLimit,
        max_bytes=s.max_body_bytes,
        paths={"/uploads": upload_limit(s), "/mcp": (body_limit(s), too_large(s))},
    )
    if keys.enabled or s.api_keys_file:  # a keys file may gain its first key later (ApiKeys.watch)
        app.add_middleware(
            KeyAuth,
            keys=keys,
            exempt={"/health", "/ready", *(PAGE if s.public_page else ())},  # probes: a balancer has no key
            exempt_prefixes=("/workers",),  # workers announce with the worker token, checked by the route
        )
    app.include_router(router)
    app.router.routes.append(Route("/mcp", mcp, include_in_schema=False))  # an ASGI app at the exact path
    app.include_router(page_router())
    app.include_router(docs_router(app.title))
    return app
