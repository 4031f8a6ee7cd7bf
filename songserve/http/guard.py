"""ASGI guards shared by both services: a bearer token and a request-body size limit.

Pure ASGI (no per-request task or body copy), so they cost little on the hot paths. Rejections use
the one error body of ``http_errors``.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send


async def send_error(send: Send, status: int, message: str, headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps({"status": "error", "error": message}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})


class BearerAuth:
    """Requires ``Authorization: Bearer <token>`` except on the exempt paths.

    ``exempt`` holds exact paths; ``exempt_prefixes`` whole subtrees (the page's static files).
    The comparison is constant-time.
    """

    def __init__(
        self,
        app: ASGIApp,
        token: str,
        exempt: set[str],
        exempt_prefixes: tuple[str, ...] = (),
        realm: str = "songserve",
        refusal: str = "",
    ) -> None:
        self.app = app
        self.refusal = refusal  # the 401's sentence; unset: the API key's
        self.expected = f"Bearer {token}".encode()
        self.exempt = exempt
        self.exempt_prefixes = exempt_prefixes
        self.realm = realm

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if asks_no_key(scope, self.exempt, self.exempt_prefixes):
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(given, self.expected):
            return await unauthorized(send, self.realm, self.refusal)
        return await self.app(scope, receive, send)


def asks_no_key(scope: Scope, exempt: set[str], exempt_prefixes: tuple[str, ...]) -> bool:
    """Not HTTP, an exempt path or subtree, or a CORS preflight: passed on unchecked."""
    return (
        scope["type"] != "http"
        or scope["path"] in exempt
        or scope["path"].startswith(exempt_prefixes)
        or scope["method"] == "OPTIONS"
    )


async def unauthorized(send: Send, realm: str = "songserve", refusal: str = "") -> None:
    """The one 401: the error body and a ``WWW-Authenticate`` challenge for the realm."""
    await send_error(
        send,
        401,
        refusal or "Missing or wrong credentials: send Authorization: Bearer <key>.",
        [(b"www-authenticate", f'Bearer realm="{realm}"'.encode())],
    )


class BodyLimit:
    """Rejects request bodies over ``max_bytes``: by Content-Length before a byte is read, and without
    one (chunked) as the app reads, never holding the body itself.

    ``paths`` gives routes that take files their own limit and sentence (exact path → (bytes, what
    to say)): an upload's audio is larger than any JSON body, and the answer names the setting. A key
    ending in ``/`` is a prefix (``/adapters/`` for ``/adapters/{name}``).
    Put it inside the key check (added before it), so no body is read for a caller without a key."""

    def __init__(self, app: ASGIApp, max_bytes: int, paths: dict[str, tuple[int, str]] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.paths = paths or {}
        self.prefixes = [(p, v) for p, v in self.paths.items() if p.endswith("/")]

    def limit(self, path: str) -> tuple[int, str]:
        """The body limit of ``path`` and its sentence."""
        if path in self.paths:
            return self.paths[path]
        return next((v for p, v in self.prefixes if path.startswith(p)), (self.max_bytes, ""))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit, said = self.limit(scope["path"])
        too_large = said or f"The request body is larger than {limit} bytes."
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await send_error(send, 413, too_large)
        if length is not None or scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            return await self.app(scope, receive, send)  # the server reads no more than Content-Length
        size, refused, started = 0, False, False

        async def counted() -> Message:
            nonlocal size, refused
            message = await receive()
            if message["type"] == "http.request":
                size += len(message.get("body", b""))
                if size > limit and not refused:
                    refused = True
                    if not started:
                        await send_error(send, 413, too_large)
                    return {"type": "http.disconnect"}  # the app stops reading: its answer is ours
            return message

        async def answered(message: Message) -> None:
            nonlocal started
            if not refused:
                started = started or message["type"] == "http.response.start"
                await send(message)

        try:
            await self.app(scope, counted, answered)
        except Exception:
            if not refused:  # the app's own failure; one that came of the cut body was answered with the 413
                raise
