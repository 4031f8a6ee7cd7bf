"""Repaints and openings of a tiny-set take through a real dispatcher and a real model worker over HTTP.

What a person gets back, in files: a repaint of 10-15 s of a half-minute take has the original's WAV
samples, bit for bit on the CPU, everywhere outside ``[start − 1 s, join + 1 s]``, and outside its
``metadata.repainted.changed_samples``; its three candidates differ inside and agree outside; the same for a repaint of two parts in one request
(two candidates), outside both. An opening
of 4 s before the take keeps every code of the take after the join, and its WAV samples after its
``changed_samples``, and makes the song longer by the opening, within a join window. The worker made
the original, so each edit decodes only the decoder chunks that hold its changed samples
(``repainted.decoded_chunks``) and takes the rest from the original's audio it kept.
"""

from __future__ import annotations

import io

import httpx
import numpy as np
import pytest
import soundfile as sf

from songserve.audio import codes
from tests.support.http import TLS
from tests.support.tiny_site import tiny_site

SONG = {"tags": "pop, piano", "lyrics": "[verse]\nkeep the ends\nrepaint the middle", "duration": 0.5}
WAIT = 600.0  # seconds: a half-minute take is seconds on an idle core, minutes under load
RATE, HOP = 44_100, 2_048


@pytest.fixture(scope="module")
def site(shared_tiny, tmp_path_factory):
    with tiny_site(shared_tiny, tmp_path_factory.mktemp("repaint_http")) as c:
        yield c


def post(site, **body) -> str:
    r = httpx.post(f"{site.url}/generate", json=body, timeout=30, verify=TLS)
    assert r.status_code == 200, r.text
    return str(r.json()["job_id"])


def fetch(site, job_id: str, index: int, kind: str) -> bytes:
    r = httpx.get(f"{site.url}/job/{job_id}/track/{index}/{kind}", timeout=30, verify=TLS)
    assert r.status_code == 200, r.text
    return r.content


@pytest.fixture(scope="module")
def original(site):
    job = site.wait_job(post(site, **SONG, num_tracks=1, seed=3), timeout=WAIT)
    assert job["status"] == "completed", job
    wav, _ = sf.read(io.BytesIO(fetch(site, job["job_id"], 0, "wav")), dtype="int16")
    return job["job_id"], wav, codes.decode(fetch(site, job["job_id"], 0, "codes"))


def test_a_repaint_leaves_every_sample_outside_its_part_as_the_original_made_it(site, original):
    job0, wav0, grid0 = original
    cf = {"job_id": job0, "track_index": 0, "at_sec": 10.0, "end_sec": 15.0}
    job = site.wait_job(post(site, continue_from=cf, num_tracks=3, seed=40), timeout=WAIT)
    assert job["status"] == "completed", job
    insides = []
    for t in job["tracks"]:
        span = t["metadata"]["repainted"]
        start, join = span["start_frame"], span["join_frame"]
        wav, _ = sf.read(io.BytesIO(fetch(site, job["job_id"], t["index"], "wav")), dtype="int16")
        assert wav.shape == wav0.shape
        lo, hi = start * HOP - RATE, join * HOP + RATE
        assert np.array_equal(wav[:lo], wav0[:lo])  # the original's very samples
        assert np.array_equal(wav[hi:], wav0[hi:])
        differ = np.nonzero((wav != wav0).any(axis=1))[0]
        first, last = span["changed_samples"]
        assert first <= differ.min(), (differ.min(), span)
        assert differ.max() < last, (differ.max(), span)
        assert span["join_score"] <= span["end_score"]
        decoded, of = span["decoded_chunks"]
        assert 0 < decoded < of  # the original's audio was at hand: only the chunks of its changed samples
        grid = codes.decode(fetch(site, job["job_id"], t["index"], "codes"))
        assert np.array_equal(grid.codes[:, :start], grid0.codes[:, :start])
        assert np.array_equal(grid.codes[:, join:], grid0.codes[:, join:])
        insides.append(wav[start * HOP : (join - 12) * HOP].tobytes())
        print(
            f"take {t['index']}: join {join} (end {span['end_frame']}), score {span['join_score']:.3f} "
            f"vs {span['end_score']:.3f} at end; samples differ {differ.min()}..{differ.max()}"
        )
    assert len(set(insides)) == 3  # three candidates


def test_a_repaint_of_two_parts_in_one_request_leaves_every_sample_outside_both_as_the_original_made_it(site, original):
    job0, wav0, grid0 = original
    parts = [{"at_sec": 4.0, "end_sec": 7.0}, {"at_sec": 15.0, "end_sec": 18.0}]
    cf = {"job_id": job0, "track_index": 0, "parts": parts}
    job = site.wait_job(post(site, continue_from=cf, num_tracks=2, seed=42), timeout=WAIT)
    assert job["status"] == "completed", job
    insides = []
    for t in job["tracks"]:
        meta = t["metadata"]["repainted"]
        wav, _ = sf.read(io.BytesIO(fetch(site, job["job_id"], t["index"], "wav")), dtype="int16")
        grid = codes.decode(fetch(site, job["job_id"], t["index"], "codes"))
        assert wav.shape == wav0.shape
        same = np.ones(len(wav0), dtype=bool)  # outside every part's changed samples
        near = np.ones(len(wav0), dtype=bool)  # outside [start − 1 s, join + 1 s] of every part
        kept = np.ones(grid0.frames, dtype=bool)
        for part in meta["parts"]:
            start, join = part["start_frame"], part["join_frame"]
            first, last = part["changed_samples"]
            same[first:last] = False
            near[max(0, start * HOP - RATE) : join * HOP + RATE] = False
            kept[start:join] = False
            assert part["join_score"] <= part["end_score"]
            insides.append(wav[start * HOP : (join - 12) * HOP].tobytes())
            print(
                f"take {t['index']} part {part['start_frame']}..{part['end_frame']}: join {join}, "
                f"score {part['join_score']:.3f} vs {part['end_score']:.3f} at end"
            )
        assert np.array_equal(wav[same], wav0[same])  # the original's very samples
        assert np.array_equal(wav[near], wav0[near])
        assert np.array_equal(grid.codes[:, kept], grid0.codes[:, kept])  # every level
        differ = np.nonzero((wav != wav0).any(axis=1))[0]
        first, last = meta["changed_samples"]
        assert first <= differ.min()
        assert differ.max() < last
    assert len(set(insides)) == 4  # two candidates, each its own in both parts


def test_an_opening_before_the_take_keeps_the_take_after_its_join(site, original):
    job0, wav0, grid0 = original
    cf = {"job_id": job0, "track_index": 0, "before_sec": 4.0}
    job = site.wait_job(post(site, continue_from=cf, num_tracks=1, seed=41), timeout=WAIT)
    assert job["status"] == "completed", job
    (t,) = job["tracks"]
    span = t["metadata"]["repainted"]
    room, join = span["opening"], span["join_frame"]
    assert room == round(4.0 * RATE / HOP)
    assert room <= join <= room + span["window"]
    grid = codes.decode(fetch(site, job["job_id"], 0, "codes"))
    assert grid.frames == grid0.frames + room  # longer by the opening
    assert np.array_equal(grid.codes[:, join:], grid0.codes[:, join - room :])
    assert abs(t["duration_sec"] - (grid0.frames + room) * HOP / RATE) < 0.01
    wav, _ = sf.read(io.BytesIO(fetch(site, job["job_id"], 0, "wav")), dtype="int16")
    first, last = span["changed_samples"]
    assert first == 0
    assert room * HOP < last <= (join + 12) * HOP
    assert np.array_equal(wav[last:], wav0[last - room * HOP :])  # the original's very samples after them
    decoded, of = span["decoded_chunks"]
    assert 0 < decoded < of
