"""Stored codes and ``continue_from`` through a real dispatcher and real tone workers over HTTP.

The tone pipeline writes a deterministic code grid that starts with a request's prefix, so the
dispatcher's side of a retake (validation, inheritance, the kept frames it sends, packing, the
codes route) is checked here at tone speed. The model's side is ``test_retake_model.py``.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from songserve.audio import codes
from songserve.pipeline.numbers import FRAMES_PER_SECOND
from tests.support.http import TLS
from tests.support.servers import Cluster, cluster_of, start_reference_worker

BODY = {"tags": "pop, piano", "lyrics": "[verse]\nhello world\nsecond line", "duration": 0.1, "num_tracks": 1}


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("retake"), workers=1, delay=0.05, threads=True)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def original(site):
    job = site.submit(**BODY, seed=41)
    return site.wait_job(job["job_id"])


def submit(site: Cluster, **body) -> dict:
    """POST /generate with only these fields (``Cluster.submit`` adds its own lyrics, tags and duration)."""
    r = httpx.post(f"{site.url}/generate", json=body, timeout=10, verify=TLS)
    assert r.status_code == 200, r.text
    return r.json()


def grid_of(site: Cluster, job_id: str, index: int = 0) -> codes.CodeGrid:
    r = httpx.get(f"{site.url}/job/{job_id}/track/{index}/codes", timeout=10, verify=TLS)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/octet-stream"
    return codes.decode(r.content)


def test_every_finished_take_serves_its_code_grid_with_models_and_seed(site, original):
    track = original["tracks"][0]
    assert track["files"]["codes"] == f"/job/{original['job_id']}/track/0/codes"
    grid = grid_of(site, original["job_id"])
    assert grid.levels == 64
    assert grid.frames == int(6.0 * FRAMES_PER_SECOND)  # 0.1 min of frames
    assert grid.header["seed"] == track["seed"] == 41
    assert grid.header["models"] == {"backbone": "default_backbone", "superres": "default_superres"}
    assert grid.header["job_id"] == original["job_id"]
    assert track["metadata"]["file_bytes"]["codes"] == len(codes.encode(grid.codes, grid.header))


def test_a_retake_keeps_the_frames_before_at_sec_and_inherits_the_request(site, original):
    at = 2.5
    job = submit(site, continue_from={"job_id": original["job_id"], "track_index": 0, "at_sec": at}, num_tracks=2)
    done = site.wait_job(job["job_id"])
    assert done["status"] == "completed"
    before = grid_of(site, original["job_id"])
    keep = int(at * FRAMES_PER_SECOND)
    for t in done["tracks"]:
        grid = grid_of(site, job["job_id"], t["index"])
        assert grid.frames == before.frames  # the original's duration, inherited
        assert np.array_equal(grid.codes[:, :keep], before.codes[:, :keep])
        assert not np.array_equal(grid.codes[:, keep:], before.codes[:, keep:])  # its own seed after the cut
        assert t["metadata"]["continued"]["frames"] == keep
        assert t["metadata"]["continued"]["origin"] == f"{original['job_id']}/0"
        assert t["metadata"]["batch_size"] == 2  # retakes of one prefix go as one batch
    assert done["cleaned_lyrics"] == original["cleaned_lyrics"]


def test_a_repaint_keeps_the_take_before_at_sec_and_after_its_join_and_gives_different_candidates(site, original):
    at, end = 2.0, 4.0
    cf = {"job_id": original["job_id"], "track_index": 0, "at_sec": at, "end_sec": end}
    job = submit(site, continue_from=cf, num_tracks=3)
    done = site.wait_job(job["job_id"])
    assert done["status"] == "completed", done
    before = grid_of(site, original["job_id"])
    start = int(at * FRAMES_PER_SECOND)
    insides = []
    for t in done["tracks"]:
        span = t["metadata"]["repainted"]
        assert (span["start_frame"], span["end_frame"]) == (start, round(end * FRAMES_PER_SECOND))
        assert span["window"] == round(1.0 * FRAMES_PER_SECOND)  # REPAINT_JOIN_WINDOW_SEC's default
        assert abs(span["join_frame"] - span["end_frame"]) <= span["window"]
        grid = grid_of(site, job["job_id"], t["index"])
        join = span["join_frame"]
        assert grid.frames == before.frames  # as long as the original
        assert np.array_equal(grid.codes[:, :start], before.codes[:, :start])
        assert np.array_equal(grid.codes[:, join:], before.codes[:, join:])
        assert not np.array_equal(grid.codes[:, start:join], before.codes[:, start:join])
        insides.append(grid.codes[:, start:join].tobytes())
        assert t["metadata"]["batch_size"] == 3  # the candidates of one repaint go as one batch
    assert len(set(insides)) == 3


def test_a_repaint_of_two_parts_keeps_the_take_around_and_between_them_and_lists_them(site, original):
    parts = [{"at_sec": 1.0, "end_sec": 2.0}, {"at_sec": 3.5, "end_sec": 4.5}]
    cf = {"job_id": original["job_id"], "track_index": 0, "parts": parts}
    job = submit(site, continue_from=cf, num_tracks=3)
    done = site.wait_job(job["job_id"])
    assert done["status"] == "completed", done
    before = grid_of(site, original["job_id"])
    spans = [(int(p["at_sec"] * FRAMES_PER_SECOND), round(p["end_sec"] * FRAMES_PER_SECOND)) for p in parts]
    insides = []
    for t in done["tracks"]:
        meta = t["metadata"]["repainted"]
        assert [(p["start_frame"], p["end_frame"]) for p in meta["parts"]] == spans
        assert (meta["start_frame"], meta["end_frame"]) == (spans[0][0], spans[1][1])
        grid = grid_of(site, job["job_id"], t["index"])
        assert grid.frames == before.frames  # as long as the original
        kept = np.ones(before.frames, dtype=bool)
        for p in meta["parts"]:
            kept[p["start_frame"] : p["join_frame"]] = False
            new = grid.codes[:, p["start_frame"] : p["join_frame"]]
            assert not np.array_equal(new, before.codes[:, p["start_frame"] : p["join_frame"]])
            insides.append(new.tobytes())
        assert np.array_equal(grid.codes[:, kept], before.codes[:, kept])
        assert t["metadata"]["batch_size"] == 3  # the candidates go as one batch
    assert len(set(insides)) == 6  # three candidates, each its own in both parts
    listed = httpx.get(f"{site.url}/jobs", timeout=10, verify=TLS).json()["jobs"]
    asked = {j["job_id"]: j["asked"]["continue_from"] for j in listed}
    assert asked[job["job_id"]]["parts"] == parts
    assert asked[original["job_id"]] is None


def test_an_extension_at_the_start_writes_a_new_opening_and_keeps_the_take_after_its_join(site, original):
    job = submit(site, continue_from={"job_id": original["job_id"], "track_index": 0, "before_sec": 2.0}, num_tracks=2)
    done = site.wait_job(job["job_id"])
    assert done["status"] == "completed", done
    before = grid_of(site, original["job_id"])
    room = round(2.0 * FRAMES_PER_SECOND)
    for t in done["tracks"]:
        span = t["metadata"]["repainted"]
        assert (span["start_frame"], span["end_frame"], span["opening"]) == (0, room, room)
        assert room <= span["join_frame"] <= room + span["window"]  # the join lands inside the original
        assert "continued" not in t["metadata"]  # nothing of the original comes before the opening
        grid = grid_of(site, job["job_id"], t["index"])
        join = span["join_frame"]
        assert grid.frames == room + before.frames  # longer by the opening
        assert np.array_equal(grid.codes[:, join:], before.codes[:, join - room :])
        assert abs(t["duration_sec"] - (6.0 + 2.0)) < 0.1


def test_a_retake_can_change_the_rest_of_the_song(site, original):
    cf = {"job_id": original["job_id"], "track_index": 0, "at_sec": 1.0}
    job = submit(site, continue_from=cf, num_tracks=1, duration=0.15, lyrics="[verse]\nnew words")
    done = site.wait_job(job["job_id"])
    assert done["cleaned_lyrics"] != original["cleaned_lyrics"]
    assert grid_of(site, job["job_id"]).frames == int(9.0 * FRAMES_PER_SECOND)


@pytest.mark.parametrize(
    ("change", "field", "status"),
    [
        ({"job_id": "0123456789abcdef"}, "continue_from.job_id", 422),
        ({"track_index": 3}, "continue_from.track_index", 422),
        ({"at_sec": 6.5}, "continue_from.at_sec", 422),
        ({"at_sec": 0.01}, "continue_from.at_sec", 422),
        ({"at_sec": -1}, "continue_from.at_sec", 422),
        ({"job_id": "../../etc"}, "continue_from.job_id", 422),
        ({"surprise": 1}, "continue_from.surprise", 422),
        ({"end_sec": 7.0}, "continue_from.end_sec", 422),  # past the 6 s song
        ({"end_sec": 2.01}, "continue_from.end_sec", 422),  # shorter than a frame
        ({"end_sec": 1.0}, "continue_from", 422),  # before at_sec
        ({"end_sec": -3}, "continue_from.end_sec", 422),
        ({"end_sec": "NaN"}, "continue_from.end_sec", 422),
        ({"end_sec": "inf"}, "continue_from.end_sec", 422),
        ({"at_sec": None, "before_sec": 0.01}, "continue_from.before_sec", 422),  # shorter than a frame
        ({"at_sec": None, "before_sec": "NaN"}, "continue_from.before_sec", 422),
        ({"at_sec": None, "before_sec": 1e9}, "continue_from.before_sec", 422),
        ({"before_sec": 2.0}, "continue_from", 422),  # an opening takes no at_sec
        # several parts: each is refused as a single repaint's bounds are, and they must be apart
        ({"parts": [{"at_sec": 1.0, "end_sec": 2.0}, {"at_sec": 3.5, "end_sec": 4.5}]}, "continue_from", 422),
        ({"at_sec": None, "end_sec": 4.0, "parts": [{"at_sec": 1, "end_sec": 2}] * 2}, "continue_from", 422),
        ({"at_sec": None, "before_sec": 1.0, "parts": [{"at_sec": 1, "end_sec": 2}] * 2}, "continue_from", 422),
        ({"at_sec": None, "parts": [{"at_sec": 1.0, "end_sec": 2.0}]}, "continue_from.parts", 422),
        (
            {"at_sec": None, "parts": [{"at_sec": 0.1 * i + 0.1, "end_sec": 0.1 * i + 0.15} for i in range(9)]},
            "continue_from.parts",
            422,
        ),
        (
            {"at_sec": None, "parts": [{"at_sec": 1, "end_sec": 2}, {"at_sec": 3.5, "end_sec": "NaN"}]},
            "continue_from.parts.1.end_sec",
            422,
        ),
        (
            {"at_sec": None, "parts": [{"at_sec": "inf", "end_sec": 2}, {"at_sec": 3.5, "end_sec": 4}]},
            "continue_from.parts.0.at_sec",
            422,
        ),
        (
            {"at_sec": None, "parts": [{"at_sec": -1, "end_sec": 2}, {"at_sec": 3.5, "end_sec": 4}]},
            "continue_from.parts.0.at_sec",
            422,
        ),
        (
            {"at_sec": None, "parts": [{"at_sec": 2, "end_sec": 1}, {"at_sec": 3.5, "end_sec": 4}]},
            "continue_from.parts.0.end_sec",
            422,
        ),  # ends before it starts
        (
            {"at_sec": None, "parts": [{"at_sec": 1, "end_sec": 2, "x": 1}, {"at_sec": 3.5, "end_sec": 4}]},
            "continue_from.parts.0.x",
            422,
        ),
        (
            {"at_sec": None, "parts": [{"at_sec": 1, "end_sec": 2}, {"at_sec": 3.5, "end_sec": 7.0}]},
            "continue_from.parts.1.end_sec",
            422,
        ),  # past the 6 s song
        (
            {"at_sec": None, "parts": [{"at_sec": 1, "end_sec": 2}, {"at_sec": 6.5, "end_sec": 6.6}]},
            "continue_from.parts.1.at_sec",
            422,
        ),  # starts after the song
        (
            {"at_sec": None, "parts": [{"at_sec": 1, "end_sec": 2}, {"at_sec": 4.0, "end_sec": 4.01}]},
            "continue_from.parts.1.end_sec",
            422,
        ),  # shorter than a frame
        (
            {"at_sec": None, "parts": [{"at_sec": 1, "end_sec": 3}, {"at_sec": 2.5, "end_sec": 4}]},
            "continue_from.parts.1",
            422,
        ),  # overlapping
        (
            {"at_sec": None, "parts": [{"at_sec": 1, "end_sec": 2}, {"at_sec": 2.5, "end_sec": 4}]},
            "continue_from.parts.1",
            422,
        ),  # its start is inside the join window of the part before
        (
            {"at_sec": None, "parts": [{"at_sec": 3.5, "end_sec": 4.5}, {"at_sec": 1, "end_sec": 2}]},
            "continue_from.parts.1",
            422,
        ),  # out of order
    ],
)
def test_bad_continue_from_values_answer_4xx_naming_the_field_and_queue_nothing(site, original, change, field, status):
    before = httpx.get(f"{site.url}/status", timeout=10, verify=TLS).json()["tracks_by_status"]
    cf = {"job_id": original["job_id"], "track_index": 0, "at_sec": 2.0, **change}
    r = httpx.post(f"{site.url}/generate", json={"continue_from": cf, "num_tracks": 1}, timeout=10, verify=TLS)
    assert r.status_code == status, r.text
    body = r.json()
    assert body["status"] == "error"
    assert body["error"]
    assert any(".".join(str(x) for x in d["loc"][1:]) == field for d in body["detail"]), body
    assert httpx.get(f"{site.url}/status", timeout=10, verify=TLS).json()["tracks_by_status"] == before


def test_other_models_or_a_song_that_ends_before_the_cut_are_refused(site, original):
    cf = {"job_id": original["job_id"], "track_index": 0, "at_sec": 3.0}
    r = httpx.post(f"{site.url}/generate", json={"continue_from": cf, "backbone": "another"}, timeout=10, verify=TLS)
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["body", "backbone"]
    r = httpx.post(f"{site.url}/generate", json={"continue_from": cf, "duration": 0.05}, timeout=10, verify=TLS)
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["body", "duration"]
    repaint = {**cf, "end_sec": 4.0}
    r = httpx.post(f"{site.url}/generate", json={"continue_from": repaint, "duration": 0.2}, timeout=10, verify=TLS)
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["body", "duration"]
    assert "as long as the take it repaints" in r.json()["error"]
    opening = {"job_id": cf["job_id"], "track_index": 0, "before_sec": 2.0}
    r = httpx.post(f"{site.url}/generate", json={"continue_from": opening, "duration": 0.2}, timeout=10, verify=TLS)
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["body", "duration"]


def test_a_track_that_is_not_done_cannot_be_continued_or_give_codes(tmp_path):
    with Cluster(tmp_path, workers=1, delay=30, threads=True) as c:
        job = c.submit(**BODY)
        r = httpx.get(f"{c.url}/job/{job['job_id']}/track/0/codes", timeout=10, verify=TLS)
        assert r.status_code == 404
        cf = {"job_id": job["job_id"], "track_index": 0, "at_sec": 1.0}
        r = httpx.post(f"{c.url}/generate", json={"continue_from": cf}, timeout=10, verify=TLS)
        assert r.status_code == 422
        assert "not done" in r.json()["error"]
        httpx.delete(f"{c.url}/job/{job['job_id']}", timeout=10, verify=TLS)


def test_a_fleet_of_reference_workers_refuses_retakes_before_queuing_them(tmp_path):
    with cluster_of(tmp_path, [start_reference_worker(tmp_path, delay=0.05)]) as c:
        cf = {"job_id": "0123456789abcdef", "track_index": 0, "at_sec": 1.0}
        r = httpx.post(f"{c.url}/generate", json={"continue_from": cf}, timeout=10, verify=TLS)
        assert r.status_code == 422
        assert r.json()["detail"][0]["loc"] == ["body", "continue_from"]
        assert httpx.get(f"{c.url}/status", timeout=10, verify=TLS).json()["queued_tracks"] == 0
