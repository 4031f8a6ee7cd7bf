"""What ``/health``, ``/ready``, ``/status``, ``/config`` and ``/metrics`` read: answers, never changes.

A read-only view over the dispatcher, the settings and the event loop's lag, so the probes and the
reports depend on nothing that can submit, cancel or stop (the job service does that). Both dialects'
``/health`` read it; ACE-Step's ``/v1/models`` and ``/v1/stats`` read the fleet and the queue here.
"""

from __future__ import annotations

from songserve import __version__
from songserve.api.dispatch import readiness
from songserve.api.dispatch.dispatcher import Dispatcher
from songserve.api.jobs.facts import Fleet
from songserve.api.loop_lag import LoopLag
from songserve.api.settings import DispatcherSettings


class Readings:
    def __init__(self, s: DispatcherSettings, dispatcher: Dispatcher, lag: LoopLag) -> None:
        self._s = s
        self._dispatcher = dispatcher
        self._lag = lag

    @property
    def accepting(self) -> bool:
        """False once draining: new jobs are refused."""
        return self._dispatcher.accepting

    def health(self) -> dict[str, object]:
        """``GET /health``: alive, the version, whether it accepts jobs, the event loop's worst lag of the last
        minute (ms), and ``launch_nonce`` when ``run_backend.sh`` gave this process one."""
        nonce = {"launch_nonce": self._s.launch_nonce} if self._s.launch_nonce else {}
        lag_ms = round(self._lag.worst() * 1000, 1)
        return {"status": "ok", "version": __version__, "accepting": self.accepting, "loop_lag_max_ms": lag_ms, **nonce}

    async def status(self) -> dict[str, object]:
        return await self._dispatcher.status()

    def ready(self) -> tuple[bool, str]:
        """Ready to serve: accepting, at least one worker ready, and no background loop failing."""
        return self._dispatcher.ready()

    def workers_ready(self) -> int:
        """Workers idle or busy (able to run a track)."""
        return self._dispatcher.workers_ready()

    def metrics(self) -> bytes:
        """``GET /metrics``: the Prometheus text."""
        return self._dispatcher.metrics.render()

    def config(self) -> dict[str, object]:
        return readiness.config(self._s, self._dispatcher.fleet())

    def fleet(self) -> Fleet:
        """What the workers said they serve: models, context."""
        return self._dispatcher.fleet()

    def queue_length(self) -> int:
        """Tracks waiting for a worker."""
        return self._dispatcher.queue_length()

    @property
    def max_queue(self) -> int:
        return self._s.max_queue
