"""``run_backend.sh``'s two questions about ports, asked in Python because bash can neither bind nor parse JSON.

``ports``: can every service this launch starts bind its port? Asked before anything starts, so a
busy port ends the launch with one line naming the port and the setting that moves it, instead of
a child's traceback after the others are up. ``health``: is the process answering on a port the
one this launcher started? Each child is given a nonce (LAUNCH_NONCE) that its ``/health`` echoes;
another instance on the same port (another nonce, or none) is never taken for our own.

    python -m songserve.cli.launcher_probe ports HOST PORT WHO SETTING [HOST PORT WHO SETTING …]
        nothing and exit 0 when all are free, else one line and exit 1
    python -m songserve.cli.launcher_probe health URL NONCE
        one word: ready (ours, serving), starting (ours, not yet), other (not ours), none (no answer)
"""

from __future__ import annotations

import errno
import json
import socket
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import NamedTuple

READY = ("idle", "ok", "busy")


class Port(NamedTuple):
    host: str
    port: int
    who: str  # "the dispatcher", "worker 0", …
    setting: str  # what moves it: API_PORT, WORKER_BASE_PORT, …


def port_problem(ports: Sequence[Port]) -> str | None:
    """The first reason one of these cannot be bound as asked (one line), or None when all can."""
    seen: dict[int, Port] = {}
    for p in ports:
        if not 1 <= p.port <= 65535:
            return f"port {p.port} ({p.who}) is no port (1-65535); set {p.setting} to a free one"
        if p.port in seen:
            q = seen[p.port]
            return f"port {p.port} is given to both {q.who} and {p.who}; set {q.setting} or {p.setting} apart"
        seen[p.port] = p
    for p in ports:
        why = bind_error(p.host, p.port)
        if why:
            return f"port {p.port} ({p.who}) on {p.host} is {why}; set {p.setting} to a free port"
    return None


def bind_error(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound the way uvicorn binds it (SO_REUSEADDR), or None."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return "in use" if exc.errno == errno.EADDRINUSE else f"not available ({exc.strerror or exc})"
    return None


def health_word(url: str, nonce: str, timeout: float = 2.0) -> str:
    """ready, starting, other or none: what ``url/health`` says about being the process given ``nonce``."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout) as r:
            raw = r.read(65536)
    except urllib.error.HTTPError:
        return "other"  # ours answers /health without a key, with 200: an error status is someone else
    except OSError:
        return "none"  # not listening yet (or no longer), or silent
    try:
        body = json.loads(raw)
    except ValueError:
        return "other"  # ours answers JSON from its first answer on
    if not isinstance(body, dict) or body.get("launch_nonce") != nonce:
        return "other"
    return "ready" if body.get("status") in READY else "starting"


def main(argv: Sequence[str]) -> int:
    if argv[:1] == ["ports"] and len(argv) % 4 == 1:
        specs = [argv[i : i + 4] for i in range(1, len(argv), 4)]
        try:
            ports = [Port(h, int(p), who, setting) for h, p, who, setting in specs]
        except ValueError:
            print(f"launcher_probe: a port is not a number: {argv[1:]}")
            return 1
        problem = port_problem(ports)
        if problem:
            print(problem)
        return 1 if problem else 0
    if argv[:1] == ["health"] and len(argv) == 3:
        print(health_word(argv[1], argv[2]))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
