"""``GET /metrics``: the dispatcher's Prometheus metrics, through ``prometheus-client``.

Events (a track waited in the queue, finished, was retried) are counted when they happen, through
``DispatcherMetrics``; gauges of live state (queue, workers, jobs) are read at scrape time by a
collector over a ``LiveState`` (the dispatcher answers it), so there is one representation of each
fact and this module needs nothing of the dispatcher but those answers. Every process has its own
registry (tests run several dispatchers in one process), with the process collector in it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from songserve.api.dispatch.loops import LoopHealth
from songserve.api.dispatch.pool import WorkerView
from songserve.api.jobs.states import JobStatus, TrackStatus
from songserve.api.store.outbox import OutboxStats

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Seconds: from a second (queue waits, small stages) to an hour (a long song on a busy fleet).
BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 3600)
# Seconds the event loop woke late (``loop_lag.py``): from a millisecond (healthy) to seconds (a held loop).
LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class LiveState(Protocol):
    """What the gauges read at scrape time; none of it waits on the store."""

    def queue_length(self) -> int:
        """Tracks waiting for a worker."""

    def running_tracks(self) -> int:
        """Tracks this dispatcher runs on workers now."""

    def stored_counts(self) -> Mapping[str, int]:
        """Tracks in the store by status, as last counted (refreshed by the membership loop)."""

    def active_job_statuses(self) -> Iterable[JobStatus]:
        """The status of each active job."""

    def worker_views(self) -> Iterable[tuple[int, WorkerView]]:
        """(worker id, its state as the dispatcher sees it), for every worker in the pool."""

    def loop_health(self) -> LoopHealth: ...

    def seconds_per_audio_second(self) -> float | None:
        """Mean wall seconds per second of audio, recently (None without history)."""


class DispatcherMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        r = self.registry
        self.queue_wait = Histogram(
            "songserve_queue_wait_seconds",
            "Seconds a track waited in the queue before a worker took it.",
            buckets=BUCKETS,
            registry=r,
        )
        self.stage = Histogram(
            "songserve_stage_seconds",
            "Seconds per pipeline stage of finished tracks.",
            ["stage"],
            buckets=BUCKETS,
            registry=r,
        )
        self.end_to_end = Histogram(
            "songserve_track_seconds", "Seconds from submission to a finished track.", buckets=BUCKETS, registry=r
        )
        self.track_wall = Histogram(
            "songserve_track_wall_seconds",
            "Seconds from dispatch to done of finished tracks.",
            buckets=BUCKETS,
            registry=r,
        )
        self.track_audio = Counter("songserve_track_audio_seconds", "Seconds of audio of finished tracks.", registry=r)
        self.finished = Counter(
            "songserve_tracks_finished",
            "Tracks that reached a terminal state, by worker.",
            ["worker", "status"],
            registry=r,
        )
        self.retries = Counter(
            "songserve_track_retries", "Attempts that ended in a retry, by worker.", ["worker"], registry=r
        )
        self.worker_faults = Counter(
            "songserve_worker_faults",
            "Failures charged to a worker: answers that are not the contract, bad, oversize or late files.",
            ["worker"],
            registry=r,
        )

        self.webhook_delivered = Counter(
            "songserve_webhook_deliveries", "Webhook events delivered (a 2xx answer), by event.", ["event"], registry=r
        )
        self.webhook_failures = Counter(
            "songserve_webhook_failures",
            "Failed tries of webhook events, by reason: refused (WEBHOOK_ALLOW), timeout, connect, status.",
            ["reason"],
            registry=r,
        )
        self.webhook_given_up = Counter(
            "songserve_webhook_given_up", "Webhook events given up after WEBHOOK_MAX_AGE_SEC.", registry=r
        )
        self.loop_lag = Histogram(
            "songserve_event_loop_lag_seconds",
            "Seconds the event loop woke later than asked (a 100 ms sleep, measured continuously).",
            buckets=LAG_BUCKETS,
            registry=r,
        )

    def track_done(self, meta: dict[str, Any], end_to_end: float, wall: float, audio: float) -> None:
        """A finished track: its worker's stage timings (``meta``), and seconds end to end, on the worker, of audio."""
        timings = meta.get("timings")
        for stage, sec in timings.items() if isinstance(timings, dict) else ():
            if isinstance(sec, int | float):
                self.stage.labels(stage.removesuffix("_sec")).observe(sec)
        self.end_to_end.observe(end_to_end)
        self.track_wall.observe(wall)
        self.track_audio.inc(audio)

    def watch(self, state: LiveState) -> None:
        self.registry.register(_LiveGauges(state))

    def watch_outbox(self, stats: Callable[[], OutboxStats]) -> None:
        """The outbox's gauges, read from ``stats`` (the webhooks loop's last count) at scrape time."""
        self.registry.register(_OutboxGauges(stats))

    def watch_loop_lag(self, worst: Callable[[], float]) -> None:
        """The worst event-loop lag of the last minute, read from ``worst`` (``loop_lag.LoopLag``) at scrape time."""
        self.registry.register(_WorstLag(worst))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _LiveGauges(Collector):
    """Gauges read from the live state at scrape time."""

    def __init__(self, state: LiveState) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        d = self.state
        yield GaugeMetricFamily("songserve_queue_length", "Tracks waiting for a worker.", value=d.queue_length())
        yield GaugeMetricFamily("songserve_running_tracks", "Tracks running on workers.", value=d.running_tracks())
        stored = GaugeMetricFamily("songserve_tracks", "Stored tracks by status.", labels=["status"])
        counts = d.stored_counts()
        for status in TrackStatus:
            stored.add_metric([status.value], counts.get(status.value, 0))
        yield stored
        jobs = GaugeMetricFamily("songserve_active_jobs", "Active jobs by status.", labels=["status"])
        by_status: dict[str, int] = {}
        for job_state in d.active_job_statuses():
            by_status[job_state.value] = by_status.get(job_state.value, 0) + 1
        for s, n in sorted(by_status.items()):
            jobs.add_metric([s], n)
        yield jobs
        workers = GaugeMetricFamily(
            "songserve_worker_state", "1 for each worker's current state.", labels=["worker", "state"]
        )
        for worker_id, view in d.worker_views():
            for st in WorkerView:
                workers.add_metric([str(worker_id), st.value], float(view is st))
        yield workers
        failing = GaugeMetricFamily(
            "songserve_loop_failing", "1 while a background loop keeps failing.", labels=["loop"]
        )
        failures = CounterMetricFamily(
            "songserve_loop_failures", "Failed iterations of background loops.", labels=["loop"]
        )
        loops = d.loop_health()
        for name, state in loops.loops.items():
            failing.add_metric([name], float(name in loops.failing()))
            failures.add_metric([name], state.total_failures)
        yield failing
        yield failures
        ratio = d.seconds_per_audio_second()
        yield GaugeMetricFamily(
            "songserve_track_seconds_per_audio_second",
            "Mean wall seconds per second of audio (recent).",
            value=ratio or 0.0,
        )


class _OutboxGauges(Collector):
    """The webhook outbox's depth and the age of its oldest pending event (the whole store's)."""

    def __init__(self, stats: Callable[[], OutboxStats]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        st = self.stats()
        yield GaugeMetricFamily("songserve_webhook_outbox_depth", "Webhook events not yet delivered.", value=st.depth)
        age = max(0.0, time.time() - st.oldest) if st.oldest is not None else 0.0
        yield GaugeMetricFamily(
            "songserve_webhook_oldest_event_seconds", "Age of the oldest webhook event not yet delivered.", value=age
        )


class _WorstLag(Collector):
    """The worst event-loop lag of the recent window: a burst stays visible between two scrapes."""

    def __init__(self, worst: Callable[[], float]) -> None:
        self.worst = worst

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "songserve_event_loop_lag_max_seconds",
            "The largest event-loop lag of the last 60 s.",
            value=self.worst(),
        )
