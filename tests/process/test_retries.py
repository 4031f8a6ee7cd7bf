"""Retries that learn, through real processes.

A stand-in of our worker whose result downloads drip a byte a second (``tests/support/bad_worker.py``) beside
a healthy tone worker, under the default ``DOWNLOAD_TIMEOUT_SEC``: a copy that crawls is cut at the
floor rate (``DOWNLOAD_FLOOR_KB_PER_SEC``) instead of the whole deadline, and the retried track waits
for the other worker rather than going back to the one that just failed it.
"""

from __future__ import annotations

import time
from pathlib import Path

from tests.support.servers import cluster_of, faults_charged, start_bad_worker, start_worker, wait_for

# The healthy worker holds its first track (TEST_HOLD_FILE) until the drip's first copy is cut: busy
# then, so a retry that forgot the failure would go back to the dripping worker. (Kept busy by load
# instead, it needs 2.5 s a track and 20 tracks at DOWNLOAD_TIMEOUT_SEC's 45 s: a 56-second test.)
TONE = ("--pipeline", "test", "--test-delay-s", "0.2")
FLOOR_WINDOW_SEC = 5.0  # DOWNLOAD_FLOOR_KB_PER_SEC is judged over a copy's last 5 s


def test_a_worker_whose_downloads_drip_costs_no_job_more_than_90_seconds(tmp_path: Path) -> None:
    bad = start_bad_worker(tmp_path, "drip", "bad", *TONE[2:], "--drip-sec", "1")
    hold = tmp_path / "hold"
    hold.touch()
    good = start_worker(tmp_path, *TONE, "--test-hold-file", str(hold), name="good")
    c = cluster_of(tmp_path, [bad, good])  # worker 0 (the drip) is picked first on a tie
    try:
        jobs = [c.submit(num_tracks=1)["job_id"] for _ in range(20)]
        started = time.monotonic()
        wait_for(lambda: faults_charged(c, 0) >= 1, timeout=120, interval=0.1)
        cut = time.monotonic() - started
        time.sleep(1.0)  # the cut track's retry is placed while the healthy worker is still busy
        hold.unlink()
        finished = [c.wait_job(j, timeout=240) for j in jobs]
        took = [j["finished_at"] - j["created_at"] for j in finished]
        workers = [j["tracks"][0]["metadata"].get("worker_id") for j in finished]
        print(
            f"\n20 jobs beside a dripping worker: first copy cut after {cut:.1f} s; slowest {max(took):.1f} s, "
            f"median {sorted(took)[10]:.1f} s; attempts {[j['tracks'][0]['attempts'] for j in finished]}; "
            f"done on workers {set(workers)}"
        )
        assert cut < 3 * FLOOR_WINDOW_SEC  # at the floor rate, not at DOWNLOAD_TIMEOUT_SEC (45 s)
        assert [j["status"] for j in finished] == ["completed"] * 20
        assert max(took) < 90
        assert set(workers) == {1}
    finally:
        c.stop()
