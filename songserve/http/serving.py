"""Running an app under uvicorn with a graceful drain on SIGTERM/SIGINT, and a header-read timeout.

The first signal runs ``drain`` while the app keeps answering (new work gets 503 from the app),
then the server exits with status 0; a second signal stops at once (within ``FORCED_EXIT_SEC``).

uvicorn's h11 protocol waits forever for a client to finish its request headers (its keep-alive
timer is cancelled by the first byte), so a few hundred "slowloris" connections that trickle
bytes hold sockets and memory indefinitely. ``header_timeout_protocol`` closes a connection whose
request line and headers are not complete within ``HEADER_TIMEOUT_SEC`` of its opening, or of the
end of its previous response; the clock never runs while a request is being handled.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Awaitable, Callable
from types import FrameType

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

# After a second signal, how long the process may take to end by itself before it is ended: a model
# thread mid-step, or a thread the event loop's shutdown joins, must not keep it alive (the launcher's
# second Ctrl-C promises "at once").
FORCED_EXIT_SEC = 3.0


def _exit_now() -> None:
    log.warning("still running %.0fs after the second signal: exiting now", FORCED_EXIT_SEC)
    logging.shutdown()
    os._exit(0)


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]]) -> None:
        super().__init__(config)
        self._drain = drain
        self._draining = False
        self._drain_task: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining or not self.started:
            self.should_exit = True
            self.force_exit = self._draining
            if not self.started and not self._draining:  # it would end without a word otherwise
                log.info("signal %d before start-up ended: stopping", sig)
            if self._draining:  # the second signal: stop at once, even with a thread mid-step
                log.info("signal %d again: stopping at once", sig)
                timer = threading.Timer(FORCED_EXIT_SEC, _exit_now)
                timer.daemon = True  # a process that ends sooner by itself is not held up by it
                timer.start()
            return
        self._draining = True
        log.info("signal %d: draining", sig)
        # Signal handlers run on the main thread, which is the event loop's thread.
        asyncio.get_event_loop().call_soon(self._begin_drain)

    def _begin_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._run_drain())

    async def _run_drain(self) -> None:
        try:
            await self._drain()
        except Exception:
            log.exception("drain failed")
        finally:
            self.should_exit = True


class HeaderTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for receiving each request's headers."""

    header_timeout: float = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def handle_events(self) -> None:
        super().handle_events()
        # h11 stays IDLE on the client's side until the request line and all headers are in.
        if self.conn.their_state is not h11.IDLE:
            self._disarm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_header_timer()  # keep-alive: the next request's headers have the same deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout, self._header_timed_out)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        log.debug(
            "closing a connection from %s: no complete request headers in %.1fs", self.client, self.header_timeout
        )
        self.transport.close()


def header_timeout_protocol(seconds: float) -> type[H11Protocol]:
    """The protocol class to pass as ``uvicorn.Config(http=...)`` for a given header timeout."""
    return type("HeaderTimeoutH11Protocol", (HeaderTimeoutH11Protocol,), {"header_timeout": float(seconds)})
