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
``application/json``). The body is read up to ``MAX_BODY_BYTES`` (413 past it); multipart is parsed
by the standard library's MIME parser, which is enough for bodies of that size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from email import errors, policy
from email.message import EmailMessage
from email.parser import BytesParser
from typing import Any
from urllib.parse import parse_qsl

from starlette.requests import Request

from songserve.api.acestep.failures import AceError

MISSING_TYPE = "(missing)"


@dataclass(frozen=True)
class Upload:
    """A file field of a multipart body."""

    field: str
    filename: str
    content_type: str
    data: bytes


@dataclass
class Body:
    fields: dict[str, Any]
    uploads: dict[str, Upload] = field(default_factory=dict)


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


def _multipart(content_type: str, raw: bytes) -> Body:
    head = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode("latin-1", "replace")
    msg = BytesParser(policy=policy.HTTP).parsebytes(head + raw)
    if (
        not isinstance(msg, EmailMessage)
        or not msg.is_multipart()
        or any(isinstance(d, errors.StartBoundaryNotFoundDefect) for d in msg.defects)
    ):
        raise AceError(400, "The multipart/form-data body cannot be read (check its boundary).")
    body = Body({})
    for part in msg.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if not isinstance(name, str) or not name:
            continue
        data = part.get_payload(decode=True)
        data = data if isinstance(data, bytes) else b""
        filename = part.get_filename()
        if filename is not None:
            body.uploads[name] = Upload(name, filename, part.get_content_type(), data)
        else:
            body.fields[name] = data.decode(part.get_content_charset() or "utf-8", errors="replace")
    return body


def release_body(content_type: str | None, raw: bytes) -> Body:
    """The body of ``POST /release_task``, by ACE-Step's branch order."""
    ct = (content_type or "").strip()
    low = ct.lower()
    if low.startswith("application/json") or low.endswith("+json"):
        return Body(_json_object(raw))
    if low.startswith("multipart/form-data"):
        return _multipart(ct, raw)
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
    """The body of the other POST routes: JSON when the type says json, else a form (empty is ``{}``)."""
    ct = (content_type or "").strip()
    low = ct.lower()
    if "json" in low:
        return Body(_json_object(raw))
    if low.startswith("multipart/form-data"):
        return _multipart(ct, raw)
    return Body(_query_string(raw, first=False)) if raw.strip() else Body({})
