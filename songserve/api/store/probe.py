"""Is the job store answering in time? One probe a second, read by ``/ready``.

Why a probe of its own: the loops fail only when they happen to touch a stalled table, and a route
waits for its own statement; neither says "the store is stalled" to a load balancer. The probe asks
for the lock every write takes on the job tables (``JobStore.probe``) under a short timeout, on the
background loops' own connections, and lets it go at once, so ``/ready`` answers 503 naming the store
within ``PROBE_INTERVAL_SEC`` + ``PROBE_TIMEOUT_SEC`` of a stall (a table lock, a full pool, a dead
server) and 200 again at the first probe that gets through. It never counts as a failing loop: it
reports, it does not retry work.
"""

from __future__ import annotations

import asyncio
import logging
import time

from songserve.api.store.protocol import JobStore, StoreError

log = logging.getLogger(__name__)
PROBE_INTERVAL_SEC = 1.0
PROBE_TIMEOUT_SEC = 1.0  # the lock wait the probe allows; a write that waits longer is a stall


class StoreProbe:
    """The store's answer to the last probe: ``reason`` is empty while it answers in time."""

    def __init__(self, store: JobStore, timeout: float = PROBE_TIMEOUT_SEC) -> None:
        self.store = store
        self.timeout = timeout
        self.reason = ""
        self.failing_since: float | None = None  # monotonic

    async def step(self) -> None:
        """One probe (a loop step; never raises for the store's sake)."""
        try:
            # The store bounds its own waits; this bounds anything it could not (a connect that hangs).
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancel that meets a result.
            async with asyncio.timeout(3 * self.timeout + 1):
                await self.store.probe(self.timeout)
        except (StoreError, TimeoutError) as exc:
            why = (
                str(exc.args[0])
                if isinstance(exc, StoreError) and exc.args
                else f"no answer in {3 * self.timeout + 1:.0f}s"
            )
            if not self.reason:
                self.failing_since = time.monotonic()
                log.warning("job store %s: not answering in time: %s", self.store.where, why)
            self.reason = why
            return
        if self.reason:
            gone = time.monotonic() - (self.failing_since or time.monotonic())
            log.info("job store %s: answering again after %.1fs", self.store.where, gone)
        self.reason, self.failing_since = "", None
