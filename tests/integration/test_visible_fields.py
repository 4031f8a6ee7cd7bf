"""Small things a user notices, through a real dispatcher and a real tone worker."""

from __future__ import annotations

import io
import re

import httpx
import pytest
import soundfile as sf

from songserve.schemas import GenerateRequest
from tests.support.http import TLS
from tests.support.servers import Cluster, wait_for


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("small"), workers=1, delay=0.05, threads=True)
    yield c
    c.stop()


def test_a_cancelled_jobs_running_track_says_cancelled_at_once(tmp_path):
    slow = Cluster(tmp_path, workers=1, delay=30.0, threads=True)  # a take that runs until it is told to stop
    try:
        job_id = slow.submit(num_tracks=2)["job_id"]
        wait_for(lambda: any(t["status"] == "generating" for t in slow.job(job_id)["tracks"]), timeout=30)
        view = httpx.delete(f"{slow.url}/job/{job_id}", timeout=10, verify=TLS).json()
        assert view["status"] == "cancelled"
        assert [t["status"] for t in view["tracks"]] == ["cancelled", "cancelled"]  # none still "generating"
        stopping = [t for t in view["tracks"] if t["phase_display"] != "Cancelled"]
        assert [t["phase_display"] for t in stopping] == ["Cancelled · stopping on its worker"] * len(stopping)
        assert all(t["stream_url"] is None for t in view["tracks"])
        final = slow.wait_job(job_id)
        assert [t["status"] for t in final["tracks"]] == ["cancelled", "cancelled"]
    finally:
        slow.stop()


def test_a_queued_track_says_why_it_waits(tmp_path):
    slow = Cluster(tmp_path, workers=1, delay=30.0, threads=True)  # its one worker stays busy
    try:
        first = slow.submit(num_tracks=1)["job_id"]
        wait_for(lambda: slow.job(first)["tracks"][0]["status"] == "generating", timeout=30)
        later = slow.submit(num_tracks=2)["job_id"]
        view = slow.job(later)
        assert [t["status"] for t in view["tracks"]] == ["queued", "queued"]
        assert [t["waiting"] for t in view["tracks"]] == ["no free worker", "no free worker"]
        assert [t["phase_display"] for t in view["tracks"]] == ["Queued · Position #1", "Queued · Position #2"]
        assert slow.job(first)["tracks"][0]["waiting"] is None  # running: nothing to wait for
        listed = httpx.get(f"{slow.url}/jobs", timeout=10, verify=TLS).json()["jobs"]
        assert [t["waiting"] for t in listed[0]["tracks"]] == ["no free worker", "no free worker"]
        cancelled = httpx.delete(f"{slow.url}/job/{later}", timeout=10, verify=TLS).json()
        assert [t["waiting"] for t in cancelled["tracks"]] == [None, None]
        httpx.delete(f"{slow.url}/job/{first}", timeout=10, verify=TLS)
    finally:
        slow.stop()


def test_a_cpu_worker_has_no_gpu_id(site):
    worker = httpx.get(site.url + "/status", verify=TLS).json()["workers"][0]
    assert worker["device"] == "cpu"
    assert worker["gpu_id"] is None


def test_the_jobs_own_mp3_carries_the_title_and_lyrics(site):
    job = site.submit(tags="pop, piano", lyrics="[verse]\nhello tags", num_tracks=2)
    assert site.wait_job(job["job_id"])["status"] == "completed"
    for i in range(2):
        mp3 = httpx.get(f"{site.url}/job/{job['job_id']}/track/{i}/mp3", verify=TLS).content
        tags = sf.SoundFile(io.BytesIO(mp3)).copy_metadata()
        assert tags["title"] == f"pop, piano (take {i + 1})"  # as the take's renders are titled
        assert tags["comment"] == "[verse]\nhello tags"


def test_the_page_asks_for_the_apis_default_duration(site):
    """Page, CLI and API agree: a song is 3 minutes unless one says otherwise (the page said 1)."""
    page = httpx.get(site.url + "/", timeout=10, verify=TLS).text
    found = re.search(r'<input id="duration"[^>]*value="([0-9.]+)"', page)
    assert found is not None, "the page has no duration field"
    assert float(found.group(1)) == GenerateRequest.model_fields["duration"].default == 3.0
