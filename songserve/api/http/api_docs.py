"""``/docs`` and ``/redoc``: the API pages (Swagger UI, ReDoc) from files this dispatcher serves itself.

Why: FastAPI's own pages load their scripts from a CDN, so on a GPU host without internet ``/docs``
was a white page. The files come from the ``fastapi-offline`` package (pinned in requirements.txt;
its releases follow Swagger UI's, which must be 5 or later to read the OpenAPI 3.1 FastAPI writes),
never from files copied into this repository. We take only its files, not its app factory: that
mounts a static folder, and a mount answers every method and path under it (``page.py`` says why
this dispatcher has none). The files are served by fixed name, so no path from a client reaches the
disk. The pages' URLs are relative, so they work behind a proxy that serves the dispatcher under a
prefix.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib.resources import files
from pathlib import Path

from fastapi import APIRouter
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse

PACKAGE_FILES = Path(str(files("fastapi_offline") / "static"))
ASSETS = {
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "swagger-ui.css": "text/css; charset=utf-8",
    "redoc.standalone.js": "text/javascript; charset=utf-8",
    "favicon.png": "image/png",
}
CACHE = "public, max-age=86400"  # a package's release: the same bytes until the dispatcher is upgraded


def _asset(path: Path, media: str) -> Callable[[], Awaitable[FileResponse]]:
    async def serve() -> FileResponse:
        return FileResponse(path, media_type=media, headers={"Cache-Control": CACHE})

    return serve


def docs_router(title: str, folder: Path = PACKAGE_FILES) -> APIRouter:
    """``GET /docs``, ``GET /redoc`` and their files under ``/docs/assets/``, outside the OpenAPI schema."""
    router = APIRouter(include_in_schema=False)

    async def swagger() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url="openapi.json",  # relative to /docs: /openapi.json, or under a proxy's prefix
            title=f"{title}: API",
            swagger_js_url="docs/assets/swagger-ui-bundle.js",
            swagger_css_url="docs/assets/swagger-ui.css",
            swagger_favicon_url="docs/assets/favicon.png",
        )

    async def redoc() -> HTMLResponse:
        return get_redoc_html(
            openapi_url="openapi.json",
            title=f"{title}: API",
            redoc_js_url="docs/assets/redoc.standalone.js",
            redoc_favicon_url="docs/assets/favicon.png",
            with_google_fonts=False,  # fonts from Google are the internet too; the system's serve
        )

    router.add_api_route("/docs", swagger, methods=["GET", "HEAD"], name="docs")
    router.add_api_route("/redoc", redoc, methods=["GET", "HEAD"], name="redoc")
    for name, media in ASSETS.items():
        router.add_api_route(
            f"/docs/assets/{name}", _asset(folder / name, media), methods=["GET", "HEAD"], name=f"docs:{name}"
        )
    return router
