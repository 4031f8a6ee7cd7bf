"""How long our HTTP clients keep an idle connection: below the servers' keep-alive.

Both services keep uvicorn's keep-alive: a connection idle for 5 s is closed (the reference's too).
Our HTTP clients (the dispatcher to its workers, the CLI to the dispatcher) drop an idle socket
sooner: at equal timeouts a request could go out on a connection the server was closing and fail
before the server saw it. A module of its own so the CLI can read it without importing a server.
"""

from __future__ import annotations

CLIENT_KEEPALIVE_SEC = 2.0
