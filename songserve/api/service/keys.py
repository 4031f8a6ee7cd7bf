"""API keys: who is calling, by name, with what limits (``API_KEY`` and ``API_KEYS_FILE``).

``API_KEYS_FILE`` is a JSON object keyed by the key itself::

    {"<key>": {"name": "studio", "tracks_per_hour": 100, "concurrent_jobs": 4, "max_duration": 10,
               "max_priority": 5, "sees": "own", "upload_adapters": true}}

Every limit is optional (absent or null: unlimited); ``upload_adapters`` (may ``POST /adapters``) is
off unless given. A key without a name is named ``key-<first 8 hex digits of its SHA-256>``. The
single ``API_KEY`` still works beside it, as a key named ``default`` with no limits that sees
everything and may upload adapters.

What a key sees (``sees``): ``own`` (the default for a file's keys) is the jobs and uploads made with
its name only: any other answers 404, as one that does not exist (reading, files, live audio,
events, cancelling, deleting, continuing from it, and the same on the ACE-Step port); ``all`` sees
every one, as an operator's key or a single shared ``API_KEY`` does. Without keys nothing is scoped.

Use is counted per name (``jobs.caller``), so two keys with one name (a key being rotated) share
their use. A key is compared in constant time against every key
(no early exit) and never logged or answered; the name is what logs, ``/usage`` and the store see.

``KeyAuth`` is the dispatcher's guard (the worker keeps ``http_guard.BearerAuth``): it answers 401 as
before and puts the caller it found into the request's scope (``CALLER``) for the routes.

A browser's ``<audio>``, download links and ``EventSource`` cannot send an ``Authorization`` header,
so a GET or HEAD may carry the key in the cookie ``songserve_key`` instead (the page sets it, with
``SameSite=Strict``). Only reads: a request that changes anything needs the header, so a cookie
alone can never submit or cancel work (no cross-site request forgery through it).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import unquote_to_bytes

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from songserve.errors import ConfigError
from songserve.http.guard import asks_no_key, unauthorized
from songserve.schemas import KeyLimits

log = logging.getLogger(__name__)
RELOAD_SEC = 2.0  # how often the keys file is looked at for changes
CALLER = "songserve.caller"  # the scope key routes read the caller from
KEY_COOKIE = "songserve_key"  # a browser's key for reads (see the module docstring)
READS = frozenset({"GET", "HEAD"})
DEFAULT_NAME = "default"  # API_KEY's name


class KeyEntry(KeyLimits):
    """One key's entry in the file: its name and its limits."""

    name: str | None = Field(None, min_length=1, max_length=100, pattern=r"^[\w .@:+-]+$")
    sees: Literal["own", "all"] = "own"  # whose jobs and uploads it may read and act on


class _KeysFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    keys: dict[str, KeyEntry]


@dataclass(frozen=True)
class Caller:
    """Who sent a request: the key's name, its limits, and whether it sees what other keys made."""

    name: str
    limits: KeyLimits
    sees_all: bool = False

    def sees(self, owner: str | None) -> bool:
        """Whether this key may read and act on a job or upload made with the key named ``owner``."""
        return self.sees_all or owner == self.name


def may_see(caller: Caller | None, owner: str | None) -> bool:
    """``caller`` (None: the dispatcher has no keys) may see what ``owner``'s key made."""
    return caller is None or caller.sees(owner)


class ApiKeys:
    """The keys this dispatcher knows; ``enabled`` when any (then every request needs one).

    The file is read again when it changes (``watch``): a key added, removed or given other limits
    applies within ``RELOAD_SEC`` without a restart. A file that cannot be used then, or one that
    would leave no key at all (every request would pass), changes nothing: the keys stay as they
    were and the log says why, once per version of the file."""

    def __init__(self, entries: list[tuple[str, Caller]], api_key: str = "", path: Path | None = None) -> None:
        self.api_key, self.path = api_key, path
        self._stamp = _stamp(path)
        self._use(entries)

    def _use(self, entries: list[tuple[str, Caller]]) -> None:
        self._entries = [(key.encode(), caller) for key, caller in entries]  # one assignment: readers see old or new
        self.enabled = bool(entries)
        self.names = sorted({caller.name for _, caller in entries})  # what a log may say of them

    @classmethod
    def load(cls, api_key: str, path: Path | None) -> ApiKeys:
        """``API_KEY`` and the file's keys; a file that cannot be read raises ``ConfigError`` in one line."""
        return cls(_entries(api_key, path), api_key, path)

    def reload_if_changed(self) -> bool:
        """Read the file again if it changed since last read; True when the keys changed."""
        stamp = _stamp(self.path)
        if self.path is None or stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            entries = _entries(self.api_key, self.path)
        except ConfigError as exc:
            log.error("%s The %d keys in use stay as they were.", exc, len(self._entries))
            return False
        if not entries and self.enabled:
            log.error(
                "Setting api_keys_file: %s now holds no key, which would let every request in; the %d keys "
                "in use stay as they were.",
                self.path,
                len(self._entries),
            )
            return False
        self._use(entries)
        log.info("keys file %s read again: %d keys (%s)", self.path, len(entries), ", ".join(self.names))
        return True

    async def watch(self, every: float = RELOAD_SEC) -> None:
        """Until cancelled: look at the file every ``every`` seconds (off the event loop)."""
        while True:
            await asyncio.sleep(every)
            await asyncio.to_thread(self.reload_if_changed)

    def identify(self, given: bytes) -> Caller | None:
        """The caller whose key ``given`` is, comparing with every key (the time says nothing of which)."""
        found = None
        for key, caller in self._entries:
            if hmac.compare_digest(given, key):
                found = caller
        return found

    def from_bearer(self, authorization: bytes) -> Caller | None:
        """``Authorization: Bearer <key>``'s caller, or None."""
        scheme, _, key = authorization.partition(b" ")
        return self.identify(key) if scheme == b"Bearer" else None


def cookie(header: bytes, name: str) -> bytes:
    """The value of cookie ``name`` in a ``Cookie`` header (percent-decoded), or b"" when absent."""
    for part in header.split(b";"):
        k, eq, v = part.strip().partition(b"=")
        if eq and k == name.encode():
            return unquote_to_bytes(v.strip(b'"'))
    return b""


def _entries(api_key: str, path: Path | None) -> list[tuple[str, Caller]]:
    """``API_KEY``'s entry and the file's, or ``ConfigError`` naming the file and its fault (never a key)."""
    operator = KeyLimits(upload_adapters=True)  # the single shared key is the operator's
    entries = [(api_key, Caller(DEFAULT_NAME, operator, sees_all=True))] if api_key else []
    if path is None:
        return entries
    try:
        raw = json.loads(path.read_text())
        parsed = _KeysFile.model_validate({"keys": raw})
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else _why(exc)
        raise ConfigError(f"Setting api_keys_file: {path} cannot be used ({why}).") from None
    for key, entry in parsed.keys.items():
        if not key or key != key.strip() or any(c.isspace() for c in key):
            raise ConfigError(f"Setting api_keys_file: {path} has a key that is empty or holds spaces.")
        name = entry.name or f"key-{hashlib.sha256(key.encode()).hexdigest()[:8]}"
        limits = KeyLimits(**entry.model_dump(exclude={"name", "sees"}))
        entries.append((key, Caller(name, limits, sees_all=entry.sees == "all")))
    return entries


def _stamp(path: Path | None) -> tuple[int, int, int] | None:
    """What tells a changed file (replaced, rewritten or touched); None when absent or unset."""
    try:
        st = path.stat() if path is not None else None
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size) if st is not None else None


def _why(exc: ValueError) -> str:
    """A file's fault without its keys: the entry is named by its position and name, never by its key."""
    if not isinstance(exc, ValidationError):
        return f"not JSON: {exc}"
    err = exc.errors()[0]
    loc = list(err["loc"])
    if len(loc) < 2:
        return "it must be a JSON object of keys"
    field = ".".join(str(p) for p in loc[2:]) or "its value"  # loc[1] is the key itself: never said
    return f"an entry's {field}: {err['msg'].lower()}"


class KeyAuth:
    """Requires a known key (``Authorization: Bearer <key>``, or for a read the ``songserve_key``
    cookie) except on the exempt paths, and names the caller in the scope (``scope[CALLER]``). The
    401 is the one ``BearerAuth`` gave."""

    def __init__(self, app: ASGIApp, keys: ApiKeys, exempt: set[str], exempt_prefixes: tuple[str, ...] = ()) -> None:
        self.app, self.keys, self.exempt, self.exempt_prefixes = app, keys, exempt, exempt_prefixes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.keys.enabled or asks_no_key(scope, self.exempt, self.exempt_prefixes):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if b"authorization" in headers or scope["method"] not in READS:
            caller = self.keys.from_bearer(headers.get(b"authorization", b""))
        else:
            caller = self.keys.identify(cookie(headers.get(b"cookie", b""), KEY_COOKIE))
        if caller is None:
            return await unauthorized(send)
        scope[CALLER] = caller
        return await self.app(scope, receive, send)
