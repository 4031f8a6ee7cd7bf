"""``GET /jobs`` through a real dispatcher and tone worker: a reloaded page finds its jobs again.

The key scopes of the list are in ``test_key_scopes.py``; the store's query on both engines in
``test_store_engines.py``.
"""

from __future__ import annotations

import httpx
import pytest

from tests.support.http import TLS
from tests.support.servers import Cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("job_list"), workers=1, delay=0.2, threads=True)
    yield c
    c.stop()


def test_jobs_lists_each_job_as_its_view_with_what_it_asked_newest_first_and_pages(cluster):
    first = cluster.submit(num_tracks=2, tags="jazz, piano", seed=3)["job_id"]
    cluster.wait_job(first)
    second = cluster.submit(num_tracks=1, mode="instrumental", tags="rock")["job_id"]
    retake = cluster.submit(continue_from={"job_id": first, "track_index": 1, "at_sec": 1.0})["job_id"]
    listed = httpx.get(cluster.url + "/jobs", timeout=10, verify=TLS).json()
    assert [j["job_id"] for j in listed["jobs"]] == [retake, second, first]
    assert listed["next_cursor"] is None
    one = listed["jobs"][2]
    view = cluster.job(first)
    assert {k: one[k] for k in view} == view  # the job's own view, field for field
    assert one["asked"] == {
        "mode": "vocal",
        "prompt_mode": "tags",
        "prompt": "",
        "tags": "jazz, piano",
        "duration": 0.05,
        "continue_from": None,
    }
    assert [t["status"] for t in one["tracks"]] == ["done", "done"]
    assert listed["jobs"][1]["asked"]["mode"] == "instrumental"
    assert listed["jobs"][0]["asked"]["continue_from"] == {
        "job_id": first,
        "track_index": 1,
        "upload_id": None,
        "at_sec": 1.0,
        "end_sec": None,  # a retake: no part repainted, no opening
        "parts": None,
        "before_sec": None,
    }

    page = httpx.get(cluster.url + "/jobs", params={"limit": 2}, timeout=10, verify=TLS).json()
    assert [j["job_id"] for j in page["jobs"]] == [retake, second]
    rest = httpx.get(
        cluster.url + "/jobs", params={"limit": 2, "cursor": page["next_cursor"]}, timeout=10, verify=TLS
    ).json()
    assert [j["job_id"] for j in rest["jobs"]] == [first]
    assert rest["next_cursor"] is None
    cluster.wait_job(retake)
    cluster.wait_job(second)


@pytest.mark.parametrize(
    ("query", "name"),
    [
        ({"limit": 0}, "limit"),
        ({"limit": 101}, "limit"),
        ({"cursor": "-1"}, "cursor"),
        ({"cursor": "x" * 30}, "cursor"),
    ],
)
def test_a_bad_limit_or_cursor_is_refused_naming_it(cluster, query, name):
    r = httpx.get(cluster.url + "/jobs", params=query, timeout=10, verify=TLS)
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["query", name]
