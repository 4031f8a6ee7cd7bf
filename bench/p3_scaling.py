"""P3: tracks/s with 8 workers vs 1 (test pipeline, fixed 0.5 s per track).

Baseline in the same run: 1 worker. Each run submits 8 tracks per worker as 1-track jobs and
measures from the first submit to the last completion.
``--smoke``: 2 workers vs 1, 1 track each of 0.05 s, the dispatcher and workers served in threads of
this process (tests/support/in_thread.py: the same apps, no process starts).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import httpx

from bench.common import args, report
from tests.support.servers import Cluster


def throughput(workers: int, per_worker: int, delay: float, threads: bool = False) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        c = Cluster(
            Path(tmp),
            workers=workers,
            delay=delay,
            api_args=("--max-queue", "1000", "--min-duration", "0.001", "--health-interval", "1.0"),
            threads=threads,
        )
        try:
            n = workers * per_worker
            with httpx.Client(base_url=c.url, timeout=30) as http:
                ids = [
                    http.post("/generate", json={"lyrics": "x", "duration": 0.002, "num_tracks": 1}).json()["job_id"]
                    for _ in range(n)
                ]
            jobs = [c.wait_job(job_id, timeout=600) for job_id in ids]
            assert all(j["status"] == "completed" for j in jobs)
            # Server timestamps: first submit to last completion, free of this client's polling lag.
            return n / (max(j["finished_at"] for j in jobs) - min(j["created_at"] for j in jobs))
        finally:
            c.stop()


def main() -> None:
    a = args(__doc__, workers=8, per_worker=8, delay=0.5)
    workers, per, delay = (2, 1, 0.05) if a.smoke else (a.workers, a.per_worker, a.delay)
    one = throughput(1, per, delay, a.smoke)
    many = throughput(workers, per, delay, a.smoke)
    report(
        "P3",
        f"{workers} workers: {many / one:.2f}x the tracks/s of 1 ({many:.2f} vs {one:.2f} tracks/s, "
        f"{delay} s per track, {per} tracks per worker)",
    )


if __name__ == "__main__":
    main()
