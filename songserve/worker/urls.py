"""The URL rules a worker's settings and its announcer share: dispatcher targets and its own address.

They live here, outside ``songserve.worker``, because ``settings.py`` checks ``ANNOUNCE`` and
``PUBLIC_URL`` at start-up (a bad URL refuses to start with one line) and the settings module must
not depend on the worker package that reads it. Pure string work: no I/O but the host's own name.
"""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

WILDCARD_HOSTS = {"0.0.0.0", "::", "[::]", ""}


def dispatcher_urls(text: str) -> list[str]:
    """``ANNOUNCE`` split into dispatcher base URLs; a bad one raises ValueError naming it.

    A dispatcher may sit behind a path prefix (a reverse proxy), so a path is kept; a query,
    fragment or credentials are refused (the token travels as a header).
    """
    urls: list[str] = []
    for raw in text.split(","):
        url = raw.strip().rstrip("/")
        if not raw.strip():
            continue
        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018  (raises on a port that is not a number)
        except ValueError:
            raise ValueError(f"{raw.strip()!r} is not a valid URL") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{raw.strip()!r} is not an http(s) URL with a host")
        if parts.query or parts.fragment or parts.username is not None or any(c.isspace() for c in url):
            raise ValueError(f"{raw.strip()!r} must be a plain http(s)://host[:port][/prefix] URL")
        if url not in urls:
            urls.append(url)
    return urls


def default_public_url(host: str, port: int) -> str:
    """Where dispatchers should call a worker bound to ``host:port``.

    A wildcard bind address (0.0.0.0, ::) names no host a dispatcher could reach, so this machine's
    fully qualified name stands in; an IPv6 literal gets its brackets.
    """
    name = socket.getfqdn() if host.strip() in WILDCARD_HOSTS else host.strip()
    if ":" in name and not name.startswith("["):
        name = f"[{name}]"
    return f"http://{name}:{port}"


def local_health_url(host: str, port: int) -> str:
    """This worker's own ``/health`` as seen from inside the process (a wildcard bind → loopback)."""
    h = host.strip()
    if h in ("0.0.0.0", ""):
        h = "127.0.0.1"
    elif h in ("::", "[::]"):
        h = "[::1]"
    elif ":" in h and not h.startswith("["):
        h = f"[{h}]"
    return f"http://{h}:{port}/health"
