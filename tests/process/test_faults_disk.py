"""No track stuck, through real processes: a frozen worker, a full worker disk, a full job store."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.support.http import TLS
from tests.support.servers import Cluster, cluster_of, fill_disk, mount_tmpfs, start_worker, wait_for


@pytest.fixture
def tmpfs(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A 16 MB tmpfs, unmounted at the end; the test is skipped (reason printed) where mounting fails."""
    mnt = tmp_path / "small"
    reason = mount_tmpfs(mnt, "16m")
    if reason:
        print(f"skipped: {reason}")
        pytest.skip(reason)
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def done_lines(c: Cluster, job_id: str) -> int:
    assert c.api is not None
    return c.api.log_tail(1_000_000).count(f"track {job_id}/0: done")


def test_a_frozen_worker_loses_its_track_which_finishes_exactly_once(tmp_path):
    c = Cluster(tmp_path, workers=2, delay=3.0, api_args=("--stall-timeout-sec", "5"))
    try:
        job_id = c.submit(num_tracks=1)["job_id"]
        t = wait_for(lambda: (t := c.job(job_id)["tracks"][0]) and t["status"] == "generating" and t, timeout=20)
        frozen = c.workers[t["worker_id"]]
        frozen.signal(signal.SIGSTOP)
        try:
            job = c.wait_job(job_id, timeout=60)
        finally:
            frozen.signal(signal.SIGCONT)
        assert job["status"] == "completed"
        assert job["tracks"][0]["attempts"] == 2
        assert job["tracks"][0]["metadata"]["worker_id"] != t["worker_id"]
        wait_for(lambda: httpx.get(c.url + "/status", verify=TLS).json()["idle_gpus"] == 2, timeout=30)  # it comes back
        assert done_lines(c, job_id) == 1
        assert c.job(job_id)["tracks"][0]["attempts"] == 2  # its late answer changed nothing
    finally:
        c.stop()


def test_one_worker_with_a_full_output_disk_costs_no_tracks(tmp_path, tmpfs):
    out = tmpfs / "audio"
    out.mkdir()
    fill_disk(tmpfs, leave_bytes=100_000)
    full = start_worker(
        tmp_path,
        "--pipeline",
        "test",
        "--test-delay-s",
        "0.2",
        "--output-dir",
        str(out),
        "--min-free-disk-mb",
        "0",
        name="full",
    )
    healthy = start_worker(tmp_path, "--pipeline", "test", "--test-delay-s", "0.2", name="healthy")
    c = cluster_of(tmp_path, [full, healthy], "--bench-after-failures", "2")
    try:
        jobs = [c.submit(num_tracks=1)["job_id"] for _ in range(20)]
        finished = [c.wait_job(j, timeout=120) for j in jobs]
        completed = sum(j["status"] == "completed" for j in finished)
        assert completed >= 19
        worker0 = httpx.get(c.url + "/status", verify=TLS).json()["workers"][0]
        assert worker0["status"] == "degraded"
        assert "output disk is full" in worker0["degraded_reason"]
    finally:
        c.stop()


def test_a_full_job_store_disk_refuses_new_jobs_and_keeps_old_ones_moving_once_space_returns(tmp_path, tmpfs):
    state = tmpfs / "state"
    c = Cluster(tmp_path, workers=1, delay=1.0, api_args=("--state-dir", str(state)))
    try:
        jobs = [c.submit(num_tracks=1)["job_id"] for _ in range(3)]
        filler = fill_disk(tmpfs)
        r = httpx.post(c.url + "/generate", json={"lyrics": "x", "duration": 0.05}, timeout=10, verify=TLS)
        assert r.status_code in (503, 507)
        assert r.json()["status"] == "error"
        assert "Retry-After" in r.headers
        filler.unlink()  # space returns; no restart
        finished = [c.wait_job(j, timeout=90) for j in jobs]
        assert [j["status"] for j in finished] == ["completed"] * 3
        r = httpx.post(c.url + "/generate", json={"lyrics": "x", "duration": 0.05}, timeout=10, verify=TLS)
        assert r.status_code == 200
        assert c.wait_job(r.json()["job_id"], timeout=60)["status"] == "completed"
    finally:
        c.stop()
