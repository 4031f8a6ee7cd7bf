"""One error body, one mapping, for every route of both services.

Every error answer is ``{"status": "error", "error": "<sentence>"}`` (validation errors add
``detail``). Exceptions map to HTTP status here and nowhere else; tracebacks go to the log.

Two answers say more than the framework's: a body that is not JSON names the line and column
where it broke (``json_invalid`` carries only the character offset), and a 405 lists in ``Allow``
every method the path takes, across all its routes (the router names only the first route's).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from songserve.errors import BusyError, SongserveError

log = logging.getLogger(__name__)


def error_response(status: int, message: str, headers: dict[str, str] | None = None, **extra: object) -> JSONResponse:
    body = {"status": "error", "error": message, **extra}
    return JSONResponse(body, status_code=status, headers=headers)


def _field(loc: tuple[object, ...]) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or "body"


PYDANTIC_PREFIXES = ("Value error, ", "Assertion failed, ")


def clean_msg(msg: object) -> str:
    """pydantic's message without the "Value error, " it puts before a validator's own sentence."""
    text = str(msg)
    for prefix in PYDANTIC_PREFIXES:
        text = text.removeprefix(prefix)
    return text


def validation_message(errors: Sequence[Mapping[str, Any]]) -> str:
    first = errors[0]
    msg = clean_msg(first.get("msg", "is invalid")).rstrip(".")
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"Field '{_field(tuple(first.get('loc', ())))}': {msg}{more}."


def json_position(doc: str, pos: int) -> tuple[int, int]:
    """Line and column (both from 1) of character ``pos`` in ``doc``, as ``json.JSONDecodeError`` counts them."""
    line = doc.count("\n", 0, pos) + 1
    return line, pos - doc.rfind("\n", 0, pos)


def _json_invalid(error: Mapping[str, Any], doc: object) -> tuple[str, dict[str, object]] | None:
    """The sentence and detail entry for a body that is not JSON, or None for any other error."""
    loc = tuple(error.get("loc", ()))
    if error.get("type") != "json_invalid" or not isinstance(doc, str) or len(loc) < 2 or not isinstance(loc[1], int):
        return None
    line, column = json_position(doc, loc[1])
    reason = str((error.get("ctx") or {}).get("error", "invalid JSON"))
    where = f"line {line}, column {column} (character {loc[1]})"
    entry: dict[str, object] = {"loc": list(loc), "msg": f"{reason} at {where}", "type": "json_invalid"}
    entry.update(line=line, column=column)
    return f"The body is not valid JSON: {reason} at {where}.", entry


PROBED_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")


def allowed_methods(app: FastAPI, path: str) -> list[str]:
    """Every method some route of ``app`` serves at ``path`` (asked of the routes, not written down twice)."""
    allowed = []
    for method in PROBED_METHODS:
        probe = {"type": "http", "method": method, "path": path, "root_path": "", "headers": [], "query_string": b""}
        if any(route.matches(probe)[0] is Match.FULL for route in app.router.routes):
            allowed.append(method)
    return allowed


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        raw = exc.errors()
        if raw and (bad_json := _json_invalid(raw[0], exc.body)):
            message, entry = bad_json
            return error_response(422, message, detail=[entry])
        errors = [
            {"loc": list(e.get("loc", ())), "msg": clean_msg(e.get("msg", "")), "type": str(e.get("type", ""))}
            for e in raw
        ]
        return error_response(422, validation_message(errors), detail=errors)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "Request failed."
        headers = getattr(exc, "headers", None)
        if exc.status_code == 404 and message == "Not Found":
            message = "No such route."
        elif exc.status_code == 405:
            allowed = allowed_methods(request.app, request.url.path) or (headers or {}).get("Allow", "").split(", ")
            headers = {**(headers or {}), "Allow": ", ".join(allowed)}
            message = f"{request.method} is not allowed on {request.url.path}; it takes {' or '.join(allowed)}."
        return error_response(exc.status_code, message, headers=headers)

    @app.exception_handler(BusyError)
    async def _busy(_: Request, exc: BusyError) -> JSONResponse:
        return JSONResponse({"status": "busy", "error": str(exc)}, status_code=409)

    @app.exception_handler(SongserveError)
    async def _ours(_: Request, exc: SongserveError) -> JSONResponse:
        extra = {"detail": exc.detail} if exc.detail else {}
        return error_response(exc.http_status, str(exc), headers=exc.headers, **extra, **(exc.extra or {}))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, "Internal error; see the server log.")
