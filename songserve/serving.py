"""Running an app under uvicorn with a graceful drain on SIGTERM/SIGINT.

The first signal runs ``drain`` while the app keeps answering (new work gets 503 from the app),
then the server exits with status 0; a second signal stops at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from types import FrameType

import uvicorn

log = logging.getLogger(__name__)


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
        except Exception:  # noqa: BLE001 (shutting down regardless)
            log.exception("drain failed")
        finally:
            self.should_exit = True
