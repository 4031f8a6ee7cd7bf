"""Retries that learn (issue 35, item 9), through real processes.

A stand-in of our worker whose result downloads drip a byte a second (``tests/bad_worker.py``) beside
a healthy tone worker, under the default ``DOWNLOAD_TIMEOUT_SEC``: a copy that crawls is cut at the
floor rate (``DOWNLOAD_FLOOR_KB_PER_SEC``) instead of the whole deadline, and the retried track waits
for the other worker rather than going back to the one that just failed it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import cluster_of, start_bad_worker, start_worker

# Real-process proofs: one xdist worker runs them in order.
pytestmark = pytest.mark.process

# 2.5 s a track: the healthy worker is still busy with the rest of the 20 when a drip's copy of a track
# is cut at DOWNLOAD_TIMEOUT_SEC (45 s), which is when a retry went back to the dripping worker.
TONE = ("--pipeline", "test", "--test-delay-s", "2.5")


def test_a_worker_whose_downloads_drip_costs_no_job_more_than_90_seconds(tmp_path: Path) -> None:
    bad = start_bad_worker(tmp_path, "drip", "bad", *TONE[2:], "--drip-sec", "1")
    good = start_worker(tmp_path, *TONE, name="good")
    c = cluster_of(tmp_path, [bad, good])  # worker 0 (the drip) is picked first on a tie
    try:
        jobs = [c.submit(num_tracks=1)["job_id"] for _ in range(20)]
        finished = [c.wait_job(j, timeout=240) for j in jobs]
        took = [j["finished_at"] - j["created_at"] for j in finished]
        workers = [j["tracks"][0]["metadata"].get("worker_id") for j in finished]
        print(f"\n20 jobs beside a dripping worker: slowest {max(took):.1f} s, median {sorted(took)[10]:.1f} s; "
              f"attempts {[j['tracks'][0]['attempts'] for j in finished]}; done on workers {set(workers)}")  # fmt: skip
        assert [j["status"] for j in finished] == ["completed"] * 20
        assert max(took) < 90
        assert set(workers) == {1}
    finally:
        c.stop()
