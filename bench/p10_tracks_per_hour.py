"""P10: tracks per hour of one worker on 2-take jobs: takes one after the other vs one batch.

Real worker process, tiny set, keep_loaded. Before (the baseline, same run): each job's two takes
as two ``POST /generate`` calls in turn (what the dispatcher did). After: one
``POST /generate_batch`` with both takes (prompt prefilled once, one batched backbone and superres).
``--smoke``: one job of 0.5 s audio, no warm-up request.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import httpx

from bench.common import args, report
from tests.support.servers import start_worker


def main() -> None:
    a = args(__doc__, jobs=4, seconds=10.0)
    jobs, seconds = (1, 0.5) if a.smoke else (a.jobs, a.seconds)
    body = {"lyrics": "[verse]\nhello world", "tags": "pop, piano", "duration": seconds / 60}
    with tempfile.TemporaryDirectory() as tmp:
        w = start_worker(Path(tmp), "--runtime-mode", "keep_loaded", name="p10")
        try:
            w.wait_healthy(timeout=300)
            if not a.smoke:  # warm-up: first-use costs are neither way's
                httpx.post(w.url + "/generate", json={**body, "seed_override": 0}, timeout=600).raise_for_status()
            t0 = time.perf_counter()
            for j in range(jobs):
                for i in range(2):
                    r = httpx.post(w.url + "/generate", json={**body, "seed_override": 10 * j + i}, timeout=600)
                    r.raise_for_status()
            before = 2 * jobs / (time.perf_counter() - t0) * 3600
            t0 = time.perf_counter()
            for j in range(jobs):
                takes = [{**body, "seed_override": 10 * j + i, "task_id": f"j{j}t{i}"} for i in range(2)]
                r = httpx.post(w.url + "/generate_batch", json={"takes": takes}, timeout=600)
                r.raise_for_status()
                assert all(x["status"] == "ok" for x in r.json()["results"]), r.text
            after = 2 * jobs / (time.perf_counter() - t0) * 3600
        finally:
            w.stop()
    report(
        "P10",
        f"one worker, 2-take jobs of {seconds:g}s audio, tiny set: {after / before:.2f}x tracks/hour "
        f"({after:.0f} batched vs {before:.0f} one take at a time)",
    )


if __name__ == "__main__":
    main()
