"""One error body, one mapping, for every route of both services.

Every error answer is ``{"status": "error", "error": "<sentence>"}`` (validation errors add
``detail``). Exceptions map to HTTP status here and nowhere else; tracebacks go to the log.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from songserve.errors import BusyError, SongserveError

log = logging.getLogger(__name__)


def error_response(status: int, message: str, headers: dict[str, str] | None = None, **extra: object) -> JSONResponse:
    body = {"status": "error", "error": message, **extra}
    return JSONResponse(body, status_code=status, headers=headers)


def _field(loc: tuple[object, ...]) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or "body"


def validation_message(errors: Sequence[Mapping[str, Any]]) -> str:
    first = errors[0]
    msg = str(first.get("msg", "is invalid")).rstrip(".")
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"Field '{_field(tuple(first.get('loc', ())))}': {msg}{more}."


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            {"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
            for e in exc.errors()
        ]
        return error_response(422, validation_message(errors), detail=errors)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "Request failed."
        if exc.status_code == 404 and message == "Not Found":
            message = "No such route."
        elif exc.status_code == 405:
            message = "Method not allowed on this route."
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(BusyError)
    async def _busy(_: Request, exc: BusyError) -> JSONResponse:
        return JSONResponse({"status": "busy", "error": str(exc)}, status_code=409)

    @app.exception_handler(SongserveError)
    async def _ours(_: Request, exc: SongserveError) -> JSONResponse:
        extra = {"detail": exc.detail} if exc.detail else {}
        return error_response(exc.http_status, str(exc), headers=exc.headers, **extra)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, "Internal error; see the server log.")
