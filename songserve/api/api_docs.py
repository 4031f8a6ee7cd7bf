"""``/docs``: the interactive API page (Swagger UI) from files this dispatcher serves itself.

Why: FastAPI's own ``/docs`` loads Swagger UI from a CDN, so on a GPU host without internet it was a
white page. The assets come from the ``swagger-ui-bundle`` package (pinned in requirements.txt; its
maintainers update the bundled release), never from files copied into this repository. Only the
three files the page loads are served, by fixed name (no path from the client reaches the disk).
The page's URLs are relative, so it works behind a proxy that mounts the dispatcher under a prefix.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from fastapi import APIRouter
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse
from swagger_ui_bundle import swagger_ui_path

ASSETS = {
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "swagger-ui.css": "text/css; charset=utf-8",
    "favicon-32x32.png": "image/png",
}
CACHE = "public, max-age=86400"  # a package's release: the same bytes until the dispatcher is upgraded


def _asset(path: Path, media: str) -> Callable[[], Awaitable[FileResponse]]:
    async def serve() -> FileResponse:
        return FileResponse(path, media_type=media, headers={"Cache-Control": CACHE})

    return serve


def docs_router(title: str, folder: Path = Path(str(swagger_ui_path))) -> APIRouter:
    """``GET /docs`` and its assets under ``/docs/assets/``, outside the OpenAPI schema."""
    router = APIRouter(include_in_schema=False)

    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url="openapi.json",  # relative to /docs: /openapi.json, or under a proxy's prefix
            title=f"{title}: API",
            swagger_js_url="docs/assets/swagger-ui-bundle.js",
            swagger_css_url="docs/assets/swagger-ui.css",
            swagger_favicon_url="docs/assets/favicon-32x32.png",
        )

    router.add_api_route("/docs", docs, methods=["GET", "HEAD"], name="docs")
    for name, media in ASSETS.items():
        router.add_api_route(f"/docs/assets/{name}", _asset(folder / name, media), methods=["GET", "HEAD"],
                             name=f"docs:{name}")  # fmt: skip
    return router
