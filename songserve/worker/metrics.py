"""The worker's ``GET /metrics`` (Prometheus, through ``prometheus-client``).

Counted when it happens: tasks by outcome, task and stage seconds, audio seconds made. Read at
scrape time: whether the model thread is busy, the running batch's size, the output disk's free
space. Each runtime has its own registry, with the process collector.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from songserve.schemas import WorkerHealth

BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200)


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)
        self.tasks = Counter("songserve_worker_tasks", "Tasks that ended, by outcome.", ["outcome"], registry=r)
        self.task_seconds = Histogram(
            "songserve_worker_task_seconds",
            "Seconds from start to the end of a finished task.",
            buckets=BUCKETS,
            registry=r,
        )
        self.stage_seconds = Histogram(
            "songserve_worker_stage_seconds",
            "Seconds per pipeline stage of finished tasks.",
            ["stage"],
            buckets=BUCKETS,
            registry=r,
        )
        self.audio_seconds = Counter("songserve_worker_audio_seconds", "Seconds of audio written.", registry=r)

    def task_done(self, seconds: float, audio_sec: float, timings: dict[str, Any]) -> None:
        self.tasks.labels("done").inc()
        self.task_seconds.observe(seconds)
        self.audio_seconds.inc(audio_sec)
        for stage, sec in timings.items():
            if isinstance(sec, int | float) and stage.endswith("_sec"):
                self.stage_seconds.labels(stage.removesuffix("_sec")).observe(sec)

    def watch(self, health: Callable[[], WorkerHealth]) -> None:
        self.registry.register(_Live(health))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Live(Collector):
    def __init__(self, health: Callable[[], WorkerHealth]) -> None:
        self.health = health

    def collect(self) -> Iterator[Metric]:
        h = self.health()
        yield GaugeMetricFamily(
            "songserve_worker_busy", "1 while the model thread runs a task.", value=float(h.status == "busy")
        )
        yield GaugeMetricFamily("songserve_worker_batch_size", "Takes in the running batch.", value=h.batch_size or 0)
        if h.disk_free_mb is not None:
            yield GaugeMetricFamily(
                "songserve_worker_disk_free_mb", "Free MB on the output folder's disk.", value=h.disk_free_mb
            )
