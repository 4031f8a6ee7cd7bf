"""Supervised background loops: one failed iteration is logged and retried, never the end of the loop.

Each loop records how it is doing in ``LoopHealth``; a loop that keeps failing turns ``/ready`` red
with its reason (and shows in ``/metrics``), so a stuck dispatcher is visible instead of silent. A
failure of the store's (``StoreError``: a locked table, a restart) is an outage rather than a bug: one
line without a traceback, and a short back-off, so the loops are at work again soon after it ends.

``SharedPasses`` runs the dispatch pass one at a time for every caller that asks for one (the dispatch
loop, a submission, a freed worker), and lets one pass answer all who asked before it began.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from songserve.api.store.protocol import StoreError

log = logging.getLogger(__name__)

FAILING_AFTER = 3  # consecutive failed iterations before the loop counts as failing
MAX_BACKOFF_SEC = 30.0
STORE_BACKOFF_SEC = 2.0  # the store failed it: back at work within this of the store's return


@dataclass
class LoopState:
    failures: int = 0  # consecutive
    total_failures: int = 0
    last_error: str = ""
    last_ok_at: float = 0.0


class LoopHealth:
    def __init__(self) -> None:
        self.loops: dict[str, LoopState] = {}

    def ok(self, name: str) -> None:
        st = self.loops.setdefault(name, LoopState())
        st.failures, st.last_ok_at = 0, time.time()

    def failed(self, name: str, exc: BaseException) -> int:
        st = self.loops.setdefault(name, LoopState())
        st.failures += 1
        st.total_failures += 1
        st.last_error = f"{type(exc).__name__}: {exc}"
        return st.failures

    def failing(self) -> dict[str, str]:
        """Loops that cannot make progress: name → the last error."""
        return {n: st.last_error for n, st in self.loops.items() if st.failures >= FAILING_AFTER}


async def supervised(
    name: str,
    step: Callable[[], Awaitable[None]],
    interval: float,
    health: LoopHealth,
    *,
    wait_first: bool = False,
    max_backoff: float | None = None,
) -> None:
    """Run ``step`` forever, ``interval`` seconds apart; failures back off exponentially up to 30 s
    (or ``max_backoff``: the membership's leases lapse if it waits longer than a third of one)."""
    if wait_first:
        await asyncio.sleep(interval)
    while True:
        try:
            await step()
        except Exception as exc:
            n = health.failed(name, exc)
            stalled = isinstance(exc, StoreError)  # an outage, not a bug: /ready names it (store/probe.py)
            cap = max_backoff or (STORE_BACKOFF_SEC if stalled else MAX_BACKOFF_SEC)
            delay = min(cap, max(interval, 0.05) * 2 ** min(n, 16))
            if stalled:
                log.warning("%s loop: iteration failed (%d in a row): %s; retrying in %.1fs", name, n, exc, delay)
            else:
                log.exception("%s loop: iteration failed (%d in a row); retrying in %.1fs", name, n, delay)
            await asyncio.sleep(delay)
            continue
        health.ok(name)
        await asyncio.sleep(interval)


class SharedPasses:
    """Runs a pass (``body``) one at a time, and lets one pass answer every call made before it began.

    ``await passes()`` returns once a pass that began after the call has ended: the caller's change
    (a job queued, a worker freed) was seen. Calls that arrive while a pass runs share the next one, so
    a burst of fifty submissions waits for the pass under way and one more, not for fifty passes one
    behind another. A pass that raises covers nobody: the next caller runs its own.
    """

    def __init__(self, body: Callable[[], Awaitable[None]]) -> None:
        self._body = body
        self._lock = asyncio.Lock()
        self.asked = 0  # calls so far
        self.covered = 0  # the calls made before the last finished pass began
        self.passes = 0  # passes run

    async def __call__(self) -> None:
        self.asked += 1
        mine = self.asked
        async with self._lock:
            if self.covered >= mine:
                return
            began_after = self.asked
            self.passes += 1
            await self._body()
            self.covered = began_after
