"""One error body, one mapping, for every route of both services.

Every error answer is ``{"status": "error", "error": "<sentence>"}`` (validation errors add
``detail``). Exceptions map to HTTP status here and nowhere else; tracebacks go to the log.

Three answers say more than the framework's: a body that is not JSON names the line and column
where it broke (``json_invalid`` carries only the character offset); a body sent under another
Content-Type (curl's ``-d`` sends ``application/x-www-form-urlencoded``) is 415 naming the header to
send, where the framework said only that the body is not an object; and a 405 lists in ``Allow``
every method the path takes, across all its routes (the router names only the first route's).

The body under another type is not read as JSON, though it may be JSON: FastAPI (the reference
backend's framework) does not read it either, and a form or text body is what a browser sends
cross-site without asking CORS first, so reading it would let any web page start jobs here.
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


def is_json_type(content_type: str) -> bool:
    """``application/json`` or a ``+json`` type, as FastAPI decides whether to read a body as JSON."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _not_json_type(errors: Sequence[Mapping[str, Any]], body: object, content_type: str) -> str | None:
    """The sentence for a body that was sent, unread, under a type that is not JSON; None otherwise."""
    if not isinstance(body, bytes | bytearray) or not body or is_json_type(content_type):
        return None
    if not any(tuple(e.get("loc", ())) == ("body",) for e in errors):
        return None
    media = content_type.split(";", 1)[0].strip()[:100]
    came = f"it came as {media!r} (curl -d sends that unless given -H 'Content-Type: application/json')"
    return f"The body must be JSON sent with the header 'Content-Type: application/json'; {came if media else 'it came without one'}."


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
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        raw = exc.errors()
        if wrong_type := _not_json_type(raw, exc.body, request.headers.get("content-type", "")):
            return error_response(415, wrong_type)
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
