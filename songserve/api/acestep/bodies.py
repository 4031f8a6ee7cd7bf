"""Request bodies as ACE-Step's routes read them, with the form branches that its code breaks working.

``/release_task`` picks a reader by ``Content-Type`` (lower-cased), first match wins:
``application/json…`` or ``…+json`` → JSON; ``multipart/form-data`` → a form with file fields;
``application/x-www-form-urlencoded`` → a form; anything else (or none) → JSON if the body starts
with ``{`` or ``[``, a query string if it holds ``=``, else 415. ``/query_result``,
``/create_random_sample`` and ``/format_input`` read JSON when the type contains ``json``, else a form
(an empty body is an empty form). A JSON body must be an object.

At ACE-Step f30aee4c every form branch of ``/release_task`` answers a plain-text 500 (a keyword
passed twice); the intent is plain, so here they work: values are strings, as in any form, and
``Params`` coerces them. Invalid JSON is a 400 naming the reason (ACE-Step: a plain-text 500 under
``application/json``). A JSON or urlencoded body is read up to ``MAX_BODY_BYTES`` (413 past it);
multipart goes through the streaming form reader (``songserve/http/forms.py``: off the event loop, its
files spooled to temporary files, caps on parts, fields and sizes), with the upload cap for
``/release_task``'s files. Who may send a body that large is the routes' business (``routes.py``:
the key is checked before the body is read).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl

from starlette.requests import Request

from songserve.api.acestep.failures import AceError
from songserve.http.forms import FilePart, Form, FormError, FormLimits, FormReader, read_form

MISSING_TYPE = "(missing)"


Upload = FilePart  # a file field of a multipart body: its bytes in a spooled temporary file


@dataclass
class Body:
    fields: dict[str, Any]
    uploads: dict[str, Upload] = field(default_factory=dict)

    def close(self) -> None:
        for u in self.uploads.values():
            u.file.close()


async def read_bytes(request: Request, max_bytes: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise AceError(413, f"The request body is larger than {max_bytes} bytes.")
        chunks.append(chunk)
    return b"".join(chunks)


def _json_object(raw: bytes, hint: str = "") -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise AceError(400, f"Invalid JSON body ({exc}){hint}.") from None
    if not isinstance(value, dict):
        raise AceError(400, "JSON payload must be an object")
    return value


def _query_string(raw: bytes, first: bool) -> dict[str, Any]:
    try:
        pairs = parse_qsl(raw.decode("utf-8"), keep_blank_values=True, strict_parsing=False)
    except UnicodeDecodeError:
        raise AceError(400, "The form body is not UTF-8 text.") from None
    out: dict[str, Any] = {}
    for key, value in pairs:
        if not first or key not in out:
            out[key] = value
    return out


def read_multipart(content_type: str, raw: bytes, limits: FormLimits) -> Body:
    """A multipart body already in memory (the same reader the routes stream through)."""
    reader = FormReader(content_type, limits)
    try:
        reader.feed(raw)
        return as_body(reader.finish())
    except FormError as exc:
        reader.close()
        raise AceError(exc.status, str(exc)) from None


async def stream_multipart(request: Request, limits: FormLimits) -> Body:
    """The request's multipart body, read as it arrives (``forms.read_form``)."""
    try:
        return as_body(await read_form(request.stream(), request.headers.get("content-type", ""), limits))
    except FormError as exc:
        raise AceError(exc.status, str(exc)) from None


def as_body(form: Form) -> Body:
    return Body(dict(form.fields), dict(form.files))


def is_multipart(content_type: str | None) -> bool:
    return (content_type or "").strip().lower().startswith("multipart/form-data")


def release_body(content_type: str | None, raw: bytes) -> Body:
    """The body of ``POST /release_task`` but multipart (``stream_multipart``), by ACE-Step's branch order."""
    ct = (content_type or "").strip()
    low = ct.lower()
    if low.startswith("application/json") or low.endswith("+json"):
        return Body(_json_object(raw))
    if low.startswith("application/x-www-form-urlencoded"):
        return Body(_query_string(raw, first=False))
    text = raw.lstrip()
    if text.startswith((b"{", b"[")):
        return Body(_json_object(raw, " (hint: set 'Content-Type: application/json')"))
    if text and b"=" in text:
        return Body(_query_string(raw, first=True))
    raise AceError(
        415,
        f"Unsupported Content-Type: {ct or MISSING_TYPE}; use application/json, "
        "application/x-www-form-urlencoded, or multipart/form-data",
    )


def small_body(content_type: str | None, raw: bytes) -> Body:
    """The body of the other POST routes but multipart: JSON when the type says json, else a form (empty is ``{}``)."""
    ct = (content_type or "").strip()
    low = ct.lower()
    if "json" in low:
        return Body(_json_object(raw))
    return Body(_query_string(raw, first=False)) if raw.strip() else Body({})
