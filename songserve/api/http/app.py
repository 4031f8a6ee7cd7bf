"""The dispatcher's application: its lifespan (``compose.build``), middleware, routes and the page."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.routing import Route

from songserve import __version__
from songserve.api.compose import Checked, build
from songserve.api.http.api_docs import docs_router
from songserve.api.http.page import FILES, page_router
from songserve.api.http.routes import router
from songserve.api.mcp.server import McpServer, body_limit, too_large
from songserve.api.service.adapters import adapter_limit
from songserve.api.service.keys import KeyAuth
from songserve.api.service.uploads import upload_limit
from songserve.api.settings import DispatcherSettings
from songserve.http.errors import install_error_handlers
from songserve.http.guard import BodyLimit

PAGE = {*FILES, "/tags"}
LOCAL_ORIGINS = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?"  # any port of this machine


def cors_origins(s: DispatcherSettings) -> list[str]:
    """``CORS_ORIGINS``: origins allowed besides the local ones (both dialects' ports)."""
    return [o.strip() for o in s.cors_origins.split(",") if o.strip()]


DESCRIPTION = (
    "Song generation dispatcher: jobs of tracks over a pool of GPU workers. Assistants call it as an MCP server at "
    "/mcp (Streamable HTTP, the same API keys as bearer tokens; docs/mcp.md)."
)


def create_app(checked: Checked) -> FastAPI:
    """The app over the parts ``compose.build`` makes in its lifespan (``app.state.parts``)."""
    s, keys = checked.s, checked.keys
    mcp = McpServer(s, lambda: app.state.parts)  # /mcp: the tools over the same parts

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with build(checked) as parts:
            app.state.parts = parts
            async with mcp.running():
                yield

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
    # The body limit inside the key check: a caller without a key gets its 401 before a byte is read.
    app.add_middleware(
        BodyLimit,
        max_bytes=s.max_body_bytes,
        paths={"/uploads": upload_limit(s), "/adapters": adapter_limit(s), "/mcp": (body_limit(s), too_large(s))},
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
