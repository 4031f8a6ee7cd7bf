"""``GET /job/{id}/track/{i}/render`` through a real dispatcher and a real tone worker: formats, loudness,
ranges, tags, the cache, and every bad parameter as a 422 naming it."""

from __future__ import annotations

import io

import httpx
import numpy as np
import pyloudnorm
import pytest
import soundfile as sf

from songserve.api.results import render
from tests.support.http import TLS
from tests.support.servers import Cluster


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("render"), workers=1, delay=0.05, threads=True)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def job_id(site):
    job = site.submit(tags="pop, piano", lyrics="[verse]\nhello render\nsecond line", duration=0.1, num_tracks=1)
    assert site.wait_job(job["job_id"])["status"] == "completed"
    return job["job_id"]


def get(site, job_id, **params):
    return httpx.get(f"{site.url}/job/{job_id}/track/0/render", params=params, timeout=60, verify=TLS)


def loudness(data: bytes) -> tuple[float, np.ndarray, int]:
    x, rate = sf.read(io.BytesIO(data), always_2d=True)
    return pyloudnorm.Meter(rate).integrated_loudness(x), x, rate


@pytest.mark.parametrize(
    ("fmt", "target", "rate", "media"), [("flac", -14.0, 44100, "audio/flac"), ("opus", -20.0, 48000, "audio/ogg")]
)
def test_flac_and_opus_decode_at_the_asked_loudness_with_title_and_lyrics(site, job_id, fmt, target, rate, media):
    r = get(site, job_id, format=fmt, loudness=target)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == media
    assert r.headers["x-render-limited"] == "false"
    assert f'filename="{job_id}_track0_{target:g}LUFS.{fmt}"' in r.headers["content-disposition"]
    measured, x, got_rate = loudness(r.content)
    assert got_rate == rate
    assert abs(measured - target) <= 0.5, measured
    assert x.shape[1] == 2
    assert abs(x.shape[0] / rate - 6.0) < 0.1
    tags = sf.SoundFile(io.BytesIO(r.content)).copy_metadata()
    assert tags["title"] == "pop, piano (take 1)"
    assert tags["comment"] == "[verse]\nhello render\nsecond line"


def test_a_time_range_in_mp3_and_wav(site, job_id):
    for fmt in ("mp3", "wav"):
        r = get(site, job_id, format=fmt, start=1.0, end=3.5)
        assert r.status_code == 200, r.text
        x, rate = sf.read(io.BytesIO(r.content))
        assert abs(x.shape[0] / rate - 2.5) < 0.06  # MP3 frames pad by a few ms
        assert "x-render-loudness" not in r.headers  # no loudness asked: the samples as stored
        assert f'filename="{job_id}_track0_1-3.5s.{fmt}"' in r.headers["content-disposition"]  # the range is named
    wav = sf.read(io.BytesIO(httpx.get(f"{site.url}/job/{job_id}/track/0/wav", verify=TLS).content), dtype="int16")[0]
    cut = sf.read(io.BytesIO(get(site, job_id, format="wav", start=1.0, end=3.5).content), dtype="int16")[0]
    assert np.array_equal(cut, wav[44100 : 44100 * 7 // 2])


def test_a_render_is_made_once_then_served_from_the_results_folder(site, job_id):
    first = get(site, job_id, format="flac", loudness=-16)
    folder = site.tmp / "state" / "results" / job_id
    made = sorted(p.name for p in folder.glob("track_0.render-*.flac"))
    again = get(site, job_id, format="flac", loudness=-16.02)  # the same render, to 0.1 LU
    assert again.content == first.content
    assert sorted(p.name for p in folder.glob("track_0.render-*.flac")) == made
    part = httpx.get(
        f"{site.url}/job/{job_id}/track/0/render",
        params={"format": "flac", "loudness": -16},
        headers={"Range": "bytes=0-99"},
        verify=TLS,
    )
    assert part.status_code == 206
    assert part.content == first.content[:100]


def test_a_target_past_the_ceiling_stops_at_it_and_says_so(tmp_path):
    """The tone is too even to reach the ceiling within the range: a spiky signal in-process instead."""
    rng = np.random.default_rng(0)
    x = 0.02 * rng.standard_normal((44100 * 3, 2))
    x[::4410] = 0.9  # sparse peaks: a crest factor far above any limit a -10 LUFS target leaves
    sf.write(tmp_path / "in.wav", x, 44100, subtype="PCM_16")
    spec = render.parse("wav", -10, None, None, 3.0)
    info = render.render_file(tmp_path / "in.wav", tmp_path / "out.wav", spec, "t", "l")
    assert info["limited"] is True
    measured, y, _ = loudness((tmp_path / "out.wav").read_bytes())
    assert 20 * np.log10(np.abs(y).max()) <= render.CEILING_DBFS + 0.01
    assert abs(measured - info["reached"]) <= 0.1
    assert info["reached"] < -10.5


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"format": "ogg"}, "format"),
        ({"loudness": 0}, "loudness"),
        ({"loudness": -90}, "loudness"),
        ({"loudness": "loud"}, "loudness"),
        ({"loudness": "nan"}, "loudness"),
        ({"start": 6.5}, "start"),
        ({"start": -1}, "start"),
        ({"start": 2, "end": 1}, "end"),
        ({"end": 60}, "end"),
        ({"start": 1, "end": 1.2, "loudness": -14}, "loudness"),  # too short to measure
    ],
)
def test_bad_parameters_are_422_naming_the_field(site, job_id, params, field):
    r = get(site, job_id, **params)
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["status"] == "error"
    assert body["detail"][0]["loc"] == ["query", field], body


def test_a_track_that_is_not_there_has_no_render(site, job_id):
    assert get(site, job_id.replace(job_id[0], "f" if job_id[0] != "f" else "e"), format="flac").status_code == 404
    r = httpx.get(f"{site.url}/job/{job_id}/track/3/render", timeout=10, verify=TLS)
    assert r.status_code == 400


@pytest.mark.parametrize("lyrics", ["", "[inst]"])
def test_an_instrumental_take_renders_in_every_format_without_a_lyrics_comment(site, lyrics):
    """libsndfile refuses an empty comment tag ("bad string") in every format: an instrumental gets none, not a 500."""
    job = site.submit(tags="ambient", lyrics=lyrics, mode="instrumental", duration=0.05, num_tracks=1)
    assert site.wait_job(job["job_id"])["status"] == "completed"
    for fmt in render.FORMATS:
        r = get(site, job["job_id"], format=fmt, loudness=-18)
        assert r.status_code == 200, (fmt, r.text)
        tags = sf.SoundFile(io.BytesIO(r.content)).copy_metadata()
        assert tags["title"] == "ambient (take 1)"
        assert not tags.get("comment"), (fmt, tags)
