"""The dialect's errors: one body that both kinds of ACE-Step client can read, one mapping.

ACE-Step's own errors are FastAPI's ``{"detail": "<reason>"}``, which scripts written against its
docs read; its Studio page and wrappers read the wrapper's ``code`` and ``error`` instead (the Studio
tests ``code === 200`` and shows ``error``). Every refusal here carries all three, beside our own
``"status": "error"`` (docs/api.md), with the HTTP status ACE-Step uses: 400 for a parameter, 401,
403/404 for audio, 413, 415 for a body it cannot read, 422 for a missing query parameter, 429 with
``Retry-After`` for a full queue or a key over its limit (with ``limit`` naming it). Tracebacks go to the log only.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from songserve.api.acestep.wrapper import wrap
from songserve.errors import FieldError, SongserveError
from songserve.http.errors import validation_message

log = logging.getLogger(__name__)


class AceError(SongserveError):
    """A request the dialect refuses, with the status ACE-Step gives it."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.http_status = status
        self.headers = headers


def field_error(name: str, why: str) -> AceError:
    """400 naming the parameter as the client sent it (its alias, or ``param_obj.x``)."""
    return AceError(400, f"Field '{name}': {why}.")


def error_response(
    status: int,
    message: str,
    headers: dict[str, str] | None = None,
    detail: object = None,
    extra: dict[str, object] | None = None,
) -> JSONResponse:
    body = {
        "status": "error",
        "detail": message if detail is None else detail,
        **(extra or {}),
        **wrap(None, code=status, error=message),
    }
    return JSONResponse(body, status_code=status, headers=headers)


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
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(SongserveError)
    async def _ours(request: Request, exc: SongserveError) -> JSONResponse:
        # A FieldError that was not renamed to ACE-Step's parameter still names ours: a 400 here.
        status = 400 if isinstance(exc, FieldError) else exc.http_status
        if status >= 500:
            log.warning("acestep %s %s: %d %s", request.method, request.url.path, status, exc)
        return error_response(status, str(exc), headers=exc.headers, extra=exc.extra)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("acestep: unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, "Internal error; see the server log.")
