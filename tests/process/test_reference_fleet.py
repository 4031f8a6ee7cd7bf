"""Mixed fleets: our dispatcher driving the reference worker (its stand-in, tests/support/reference_worker.py)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.http import TLS
from tests.support.servers import Cluster, cluster_of, start_reference_worker, start_worker, wait_for


def requests_seen(tmp, name: str = "reference") -> list[dict]:
    path = tmp / f"{name}_requests.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def ref_only(tmp_path):
    c = cluster_of(tmp_path, [start_reference_worker(tmp_path, delay=1.5)])
    yield c
    c.stop()


def test_a_reference_worker_is_shown_as_such(ref_only):
    workers = httpx.get(ref_only.url + "/status", verify=TLS).json()["workers"]
    assert workers[0]["kind"] == "reference"
    assert workers[0]["status"] == "idle"
    assert httpx.get(ref_only.url + "/config", verify=TLS).json()["backbone_models"] == ["default_backbone"]


def test_a_vocal_job_completes_on_a_reference_worker_with_its_progress(ref_only, tmp_path):
    job_id = ref_only.submit(num_tracks=1, duration=0.5, lyrics="hello\nworld", tags="Pop")["job_id"]
    moving = wait_for(
        lambda: (t := ref_only.job(job_id)["tracks"][0]) and "tokens" in t["phase_display"] and t, timeout=30
    )
    assert moving["progress"] > 1
    job = ref_only.wait_job(job_id)
    assert job["status"] == "completed"
    assert httpx.get(f"{ref_only.url}/job/{job_id}/track/0/mp3", verify=TLS).content[:2] in (
        b"ID",
        b"\xff\xfb",
        b"\xff\xf3",
    )
    sent = requests_seen(tmp_path)[0]
    assert sent["language"] == ""
    assert sent["duration"] == 1  # whole minutes, rounded up
    assert sent["superres_text_mode"] == "same_as_backbone_no_description"
    assert sent["lyrics"] == "hello\nworld"


def test_an_instrumental_job_sends_the_reference_its_instrumental_language(ref_only, tmp_path):
    job_id = ref_only.submit(num_tracks=1, mode="instrumental", duration=2.0, tags="Jazz")["job_id"]
    assert ref_only.wait_job(job_id)["status"] == "completed"
    sent = requests_seen(tmp_path)[0]
    assert sent["language"] == "Instrumental"
    assert sent["lyrics"] == ""
    assert sent["duration"] == 2


def test_a_reference_traceback_becomes_a_one_line_error(ref_only):
    job = ref_only.wait_job(ref_only.submit(num_tracks=1, tags="fail")["job_id"])
    assert job["status"] == "failed"
    assert job["tracks"][0]["error"] == "RuntimeError: CUDA error: an illegal memory access was encountered"


def test_a_mixed_fleet_completes_a_four_track_job(tmp_path):
    workers = [
        start_reference_worker(tmp_path, delay=1.0),
        start_worker(tmp_path, "--pipeline", "test", "--test-delay-s", "1.0", name="ours"),
    ]
    c = cluster_of(tmp_path, workers)
    try:
        kinds = sorted(w["kind"] for w in httpx.get(c.url + "/status", verify=TLS).json()["workers"])
        assert kinds == ["reference", "songserve"]
        job = c.wait_job(c.submit(num_tracks=4, duration=0.05)["job_id"], timeout=90)
        assert job["status"] == "completed"
        used = {t["metadata"]["worker_id"] for t in job["tracks"]}
        assert used == {0, 1}
        assert len(requests_seen(tmp_path)) >= 1
    finally:
        c.stop()


def test_cancelling_a_track_on_a_reference_worker_discards_its_result(tmp_path):
    hold = tmp_path / "hold"  # the take stays in its backbone until the cancel has been seen
    hold.touch()
    c = cluster_of(tmp_path, [start_reference_worker(tmp_path, delay=0.3, hold_file=hold)])
    try:
        job_id = c.submit(num_tracks=1)["job_id"]
        wait_for(lambda: c.job(job_id)["tracks"][0]["status"] == "generating", timeout=20)
        httpx.delete(f"{c.url}/job/{job_id}", verify=TLS)
        job = wait_for(lambda: (j := c.job(job_id)) and j["tracks"][0]["status"] == "cancelled" and j, timeout=20)
        assert job["status"] == "cancelled"
        hold.unlink()
        # The worker finishes on its own; then it takes the next job.
        assert c.wait_job(c.submit(num_tracks=1)["job_id"], timeout=60)["status"] == "completed"
    finally:
        c.stop()


@pytest.mark.process
def test_after_a_dispatcher_restart_a_reference_workers_track_is_queued_again(tmp_path):
    hold = tmp_path / "hold"  # the first attempt stays in its backbone until the dispatcher is dead
    hold.touch()
    c = cluster_of(tmp_path, [start_reference_worker(tmp_path, delay=0.3, hold_file=hold)])
    try:
        job_id = c.submit(num_tracks=1)["job_id"]
        wait_for(lambda: c.job(job_id)["tracks"][0]["status"] == "generating", timeout=20)
        c.api.signal(9)
        c.api.proc.wait(10)
        hold.unlink()
        c.start_api()
        job = c.wait_job(job_id, timeout=60)
        assert job["status"] == "completed"
        assert job["tracks"][0]["attempts"] == 2
    finally:
        c.stop()


def test_cluster_helper_is_unchanged_for_our_workers(tmp_path):
    with Cluster(tmp_path, workers=1, delay=0.2) as c:
        assert httpx.get(c.url + "/status", verify=TLS).json()["workers"][0]["kind"] == "songserve"
