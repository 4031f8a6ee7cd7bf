"""``GET /metrics`` in the Prometheus text format, written by hand (no client library needed)."""

from __future__ import annotations

from songserve.api.pool import WorkerView
from songserve.api.service import JobService
from songserve.api.states import TrackStatus


def render(svc: JobService) -> str:
    d = svc.dispatcher
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP songserve_{name} {help_}")
        lines.append(f"# TYPE songserve_{name} {kind}")
        lines.extend(f"songserve_{name}{labels} {value:g}" for labels, value in samples)

    metric("queue_length", "gauge", "Tracks waiting for a worker.", [("", len(d.queue))])
    metric("running_tracks", "gauge", "Tracks running on workers.", [("", len(d.running))])
    counts = svc.store.counts()
    metric(
        "tracks",
        "gauge",
        "Stored tracks by status.",
        [(f'{{status="{s.value}"}}', counts.get(s.value, 0)) for s in TrackStatus],
    )
    jobs: dict[str, int] = {}
    for job in d.jobs.values():
        st = svc.view(job.job_id).status
        jobs[st] = jobs.get(st, 0) + 1
    metric(
        "active_jobs", "gauge", "Active jobs by status.", [(f'{{status="{k}"}}', v) for k, v in sorted(jobs.items())]
    )
    metric(
        "worker_state",
        "gauge",
        "1 for each worker's current state.",
        [
            (f'{{worker="{w.worker_id}",state="{st.value}"}}', float(w.view is st))
            for w in d.pool.workers
            for st in WorkerView
        ],
    )
    stages = sorted(d.speed.stage_totals.items())
    metric(
        "stage_seconds_sum",
        "counter",
        "Seconds spent per pipeline stage (finished tracks).",
        [(f'{{stage="{k}"}}', v[0]) for k, v in stages],
    )
    metric(
        "stage_seconds_count",
        "counter",
        "Finished tracks counted per stage.",
        [(f'{{stage="{k}"}}', v[1]) for k, v in stages],
    )
    f = d.speed.finished
    metric(
        "track_audio_seconds",
        "summary",
        "Seconds of audio of tracks finished since start.",
        [("_sum", f["audio_sec"]), ("_count", f["count"])],
    )
    metric(
        "track_wall_seconds",
        "summary",
        "Wall seconds from dispatch to done, tracks finished since start.",
        [("_sum", f["wall_sec"]), ("_count", f["count"])],
    )
    metric(
        "track_seconds_per_audio_second",
        "gauge",
        "Mean wall seconds per second of audio (recent).",
        [("", d.speed.ratio() or 0.0)],
    )
    return "\n".join(lines) + "\n"
