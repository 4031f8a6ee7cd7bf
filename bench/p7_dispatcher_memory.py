"""P7: dispatcher RSS after 10,000 finished tracks vs after 100 (test pipeline, 4 workers).

Baseline in the same run: RSS after the first 100 tracks. Finished jobs live in SQLite and the
results folder, not in memory, so the difference should stay small.

``--smoke``: 8 tracks (4 before the baseline) through 1 test worker.
"""

from __future__ import annotations

import concurrent.futures as cf
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import args, report, rss_mb
from tests.support.servers import Cluster


def run_tracks(c: Cluster, n: int) -> None:
    def client(k: int) -> None:
        with httpx.Client(base_url=c.url, timeout=30) as http:
            for _ in range(k):
                while True:
                    r = http.post("/generate", json={"lyrics": "x", "duration": 0.001, "num_tracks": 1})
                    if r.status_code == 429:
                        time.sleep(0.05)
                        continue
                    r.raise_for_status()
                    break

    clients = 8
    shares = [n // clients + (1 if i < n % clients else 0) for i in range(clients)]
    with cf.ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, shares))
    deadline = time.monotonic() + 900
    with httpx.Client(base_url=c.url, timeout=10) as http:  # one connection: a bare httpx.get costs ~30 ms CPU
        while time.monotonic() < deadline:
            st = http.get("/status").json()
            if st["queued_tracks"] == 0 and st["running_tracks"] == 0:
                return
            time.sleep(0.2)
    raise TimeoutError("tracks did not finish")


def main() -> None:
    a = args(__doc__, tracks=10_000)
    total, first, workers = (8, 4, 1) if a.smoke else (a.tracks, 100, 4)
    with tempfile.TemporaryDirectory() as tmp:
        c = Cluster(
            Path(tmp),
            workers=workers,
            delay=0.0,
            api_args=("--max-queue", "400", "--min-duration", "0.001", "--log-level", "WARNING"),
        )
        try:
            pid = c.api.proc.pid
            run_tracks(c, first)
            base = rss_mb(pid)
            t0 = time.perf_counter()
            run_tracks(c, total - first)
            rate = (total - first) / (time.perf_counter() - t0)
            after = rss_mb(pid)
            done = httpx.get(c.url + "/status").json()["tracks_by_status"].get("done", 0)
        finally:
            c.stop()
    report(
        "P7",
        f"dispatcher RSS after {done} finished tracks: {after - base:+.1f} MB vs after {first} "
        f"({after:.0f} vs {base:.0f} MB; {rate:.0f} tracks/s through {workers} test workers)",
    )


if __name__ == "__main__":
    main()
