"""How late the dispatcher's event loop wakes: a task that sleeps a tenth of a second and records the overshoot.

Every route, stream and background loop of a dispatcher shares one event loop, so anything that holds
it (a blocking call, a long run of Python between two awaits) delays every answer at once. The
median of ``/health`` does not show that; the lag does: a sleep of 100 ms that wakes 2 s late means
something held the loop for about 2 s. Each overshoot goes to a Prometheus histogram
(``songserve_event_loop_lag_seconds``) and to a window of the last minute, whose worst is
``songserve_event_loop_lag_max_seconds`` and ``/health``'s ``loop_lag_max_ms``.

``LagWindow`` is the arithmetic (no loop, no clock of its own); ``LoopLag`` is the task.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable

INTERVAL_SEC = 0.1  # how long each probe sleeps: small enough to see a burst, cheap enough to run always
WINDOW_SEC = 60.0  # the worst lag is the worst of this many seconds


class LagWindow:
    """The lags seen in the last ``window`` seconds, and the worst of them (a max that forgets)."""

    def __init__(self, window: float = WINDOW_SEC) -> None:
        self.window = window
        self._seen: deque[tuple[float, float]] = deque()  # (when, lag), the lags decreasing from the left
        self.count = 0

    def record(self, now: float, lag: float) -> None:
        """A probe that ended at ``now`` (monotonic seconds) ``lag`` seconds late."""
        self.count += 1
        # Older lags no larger than this one can never be the worst again: drop them (a monotonic deque).
        while self._seen and self._seen[-1][1] <= lag:
            self._seen.pop()
        self._seen.append((now, lag))
        self._forget(now)

    def worst(self, now: float) -> float:
        """The largest lag of the last ``window`` seconds before ``now``; 0 when none was seen."""
        self._forget(now)
        return self._seen[0][1] if self._seen else 0.0

    def _forget(self, now: float) -> None:
        while self._seen and self._seen[0][0] < now - self.window:
            self._seen.popleft()


def overshoot(started: float, ended: float, interval: float) -> float:
    """How much later than ``interval`` after ``started`` the loop woke (never negative)."""
    return max(0.0, ended - started - interval)


class LoopLag:
    """The probe task: started and stopped with the dispatcher's parts (``compose.py``).

    ``observe`` receives each lag in seconds (the metrics' histogram); ``clock`` is monotonic seconds."""

    def __init__(
        self,
        observe: Callable[[float], None] = lambda lag: None,
        interval: float = INTERVAL_SEC,
        window: float = WINDOW_SEC,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.observe = observe
        self.interval = interval
        self.clock = clock
        self.window = LagWindow(window)
        self._task: asyncio.Task[None] | None = None

    def worst(self) -> float:
        """The worst lag of the last window, in seconds."""
        return self.window.worst(self.clock())

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="loop-lag")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def note(self, started: float, ended: float) -> float:
        """One probe's result: recorded and observed; returns the lag."""
        lag = overshoot(started, ended, self.interval)
        self.window.record(ended, lag)
        self.observe(lag)
        return lag

    async def _run(self) -> None:
        while True:
            started = self.clock()
            await asyncio.sleep(self.interval)
            self.note(started, self.clock())
