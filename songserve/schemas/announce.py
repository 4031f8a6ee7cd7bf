"""Workers that join a dispatcher by announcing themselves (``POST /workers``, docs/api.md).

The URL a worker announces is where the dispatcher sends everything else, so it is checked here
as a plain origin; a bad one is a 422 naming it (and refuses a worker's start-up, ``settings.py``).
"""

from __future__ import annotations

from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator


class WorkerAnnouncement(BaseModel):
    """Worker → dispatcher ``POST /workers``: "call me at ``url``"; repeating it renews the registration.

    The URL is where the dispatcher sends ``/health``, ``/generate`` and the rest, so it is a plain
    origin (scheme, host, port): a path or query would be dropped or mangled when routes are appended.
    """

    model_config = ConfigDict(extra="ignore")

    url: str = Field(
        max_length=200, description="the worker's base URL as the dispatcher should call it: http(s)://host[:port]"
    )
    ttl_sec: float = Field(
        15.0,
        ge=1.0,
        le=3600.0,
        allow_inf_nan=False,
        description="seconds the registration lasts unless renewed (workers send 3 × their announce interval)",
    )

    @field_validator("url")
    @classmethod
    def _plain_origin(cls, value: str) -> str:
        """http(s)://host[:port] with nothing after it (a trailing ``/`` is dropped); else a one-line reason."""
        try:
            parts = urlsplit(value)
            parts.port  # noqa: B018  (raises on a port that is not a number in 0..65535)
        except ValueError as exc:
            raise ValueError(f"{value!r} is not a valid URL ({exc})") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{value!r} is not an http(s) URL with a host")
        if parts.username is not None or parts.password is not None:
            raise ValueError(f"{value!r} carries credentials; the worker token is sent as a header instead")
        if parts.path not in ("", "/") or parts.query or parts.fragment or value.endswith(("?", "#")):
            raise ValueError(f"{value!r} has a path, query or fragment; give only http(s)://host[:port]")
        if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in value):
            raise ValueError(f"{value!r} contains whitespace or control characters")
        return value.rstrip("/")


class WorkerAnnounced(BaseModel):
    """Dispatcher → worker answer to ``POST /workers``: the registration and how long it lasts."""

    worker_id: int = Field(ge=0, description="the dispatcher's id for this worker; the same on every renewal")
    expires_in_sec: float = Field(ge=0, description="seconds until the registration lapses unless renewed")
