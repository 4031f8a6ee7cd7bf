"""The page's files (``songserve/web/``) as routes of their own, GET and HEAD.

Why not a static-files mount at ``/``: a mount there matches every path and every method, so it
answered ``GET /generate`` with its own 404 (and ``PUT /job/{id}`` with its 405 naming GET and
HEAD) before the router could say that the route exists and which methods it takes. With the page
as plain routes, a wrong method on any route is the router's 405 with the right ``Allow``
(``http_errors``), and a path nobody serves is a 404.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

STATIC = Path(__file__).resolve().parents[2] / "web"
# /favicon.ico: every browser asks for it; without it each load logged two console errors. An SVG
# under that name, with its own media type, which browsers draw.
FILES = {
    "/": "index.html",
    "/index.html": "index.html",
    "/app.js": "app.js",
    "/jobs.js": "jobs.js",
    "/style.css": "style.css",
    "/favicon.ico": "favicon.svg",
}
MEDIA = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}


def _serve(path: Path) -> Callable[[], Awaitable[FileResponse]]:
    """An endpoint without parameters (a parameter would be read from the query string)."""

    async def serve() -> FileResponse:
        return FileResponse(path, media_type=MEDIA[path.suffix])

    return serve


def page_router(folder: Path = STATIC) -> APIRouter:
    """Routes for the page's files in ``folder`` (none when the folder is absent)."""
    router = APIRouter(include_in_schema=False)
    if folder.is_dir():
        for route, name in FILES.items():
            router.add_api_route(route, _serve(folder / name), methods=["GET", "HEAD"], name=f"page:{name}")
    return router
