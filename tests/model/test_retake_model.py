"""A retake of a half-minute take of the tiny set, through a real dispatcher and two real model workers.

What a retake must do, end to end over HTTP: the retake from 20 s keeps the original's audio before
19 s (SNR ≥ 60 dB; here it is the same samples) and all 64 code levels of the kept frames; a
second retake of the same prefix goes to the worker holding its KV snapshot (the other one is
first in the pool's order) and prefills nothing where the first prefilled them all (≤ 10 %); a
retake from an earlier point restores that snapshot cut to its prefix; the kept audio renders as
FLAC at the asked loudness. A repaint goes to the worker that made its original (the other one is
first in the pool's order), which holds the original's decoded audio and decodes only the chunks
that hold changed samples.
"""

from __future__ import annotations

import io

import httpx
import numpy as np
import pyloudnorm
import pytest
import soundfile as sf

from songserve.audio import codes
from tests.support.http import TLS
from tests.support.servers import Cluster, start_worker, wait_for
from tests.support.tiny_site import SHARED_FLAGS, tiny_site

# Half a minute: the retakes from 20 s and 10 s still leave a new part to tell apart (a minute cost
# this test 2.4 times the tiny-set work: 208 s of audio against 88).
SONG = {"tags": "pop, piano", "lyrics": "[verse]\nkeep the start\nchange the rest", "duration": 0.5}
WAIT = 600.0  # seconds: a minute of tiny-set song takes ~10 s on an idle core, several times that under load


@pytest.fixture(scope="module")
def site(shared_tiny, tmp_path_factory):
    """Worker 0: the process's tiny-model worker, its KV snapshots cleared; worker 1: one of this file's own,
    with the same flags (the proof needs two)."""
    tmp = tmp_path_factory.mktemp("retake_model")
    second = start_worker(tmp, *SHARED_FLAGS, name="tiny1")
    try:
        second.wait_healthy(timeout=300)
        with tiny_site(shared_tiny, tmp, more=(second,)) as c:
            yield c
    finally:
        second.stop()


def post(site: Cluster, **body) -> str:
    r = httpx.post(f"{site.url}/generate", json=body, timeout=30, verify=TLS)
    assert r.status_code == 200, r.text
    return str(r.json()["job_id"])


def fetch(site: Cluster, job_id: str, kind: str, **params) -> bytes:
    r = httpx.get(f"{site.url}/job/{job_id}/track/0/{kind}", params=params, timeout=120, verify=TLS)
    assert r.status_code == 200, r.text
    return r.content


def snr_db(reference: np.ndarray, other: np.ndarray) -> float:
    noise = float(((reference.astype(np.float64) - other) ** 2).sum())
    return float("inf") if noise == 0 else 10 * np.log10(float((reference.astype(np.float64) ** 2).sum()) / noise)


def both_idle(site: Cluster) -> bool:
    return httpx.get(f"{site.url}/status", timeout=10, verify=TLS).json()["idle_gpus"] == 2


def test_a_retake_keeps_the_start_and_a_second_one_restores_its_snapshot(site):
    original = site.wait_job(post(site, **SONG, num_tracks=1, seed=3), timeout=WAIT)
    assert original["status"] == "completed", original
    job0 = original["job_id"]
    wav0, rate = sf.read(io.BytesIO(fetch(site, job0, "wav")), dtype="int16")
    grid0 = codes.decode(fetch(site, job0, "codes"))
    assert grid0.levels == 64
    assert grid0.header["seed"] == 3

    # Retake A while worker 0 is busy, so it runs on worker 1: the pool's order alone would pick 0 later.
    wait_for(lambda: both_idle(site), timeout=60)
    blocker = post(site, tags="jazz", lyrics="[verse]\nhold worker zero", duration=0.3, num_tracks=1, seed=9)
    wait_for(lambda: site.job(blocker)["tracks"][0]["worker_id"] == 0, timeout=30)
    cf = {"job_id": job0, "track_index": 0, "at_sec": 20.0}
    a = site.wait_job(post(site, continue_from=cf, num_tracks=1, seed=11), timeout=WAIT)
    assert a["status"] == "completed", a
    ta = a["tracks"][0]
    assert ta["worker_id"] == 1
    keep = int(20.0 * grid0.header["frame_rate"])
    tokens = ta["metadata"]["prefill"]["tokens"]
    assert ta["metadata"]["prefill"]["restored"] == 0
    assert ta["metadata"]["continued"] == {
        "frames": keep,
        "at_sec": pytest.approx(keep / grid0.header["frame_rate"]),
        "origin": f"{job0}/0",
    }
    assert tokens == ta["metadata"]["tokens"]["backbone_prompt"] + 2 * keep

    grid_a = codes.decode(fetch(site, a["job_id"], "codes"))
    assert grid_a.frames == grid0.frames  # one whole song of the original's length
    assert np.array_equal(grid_a.codes[:, :keep], grid0.codes[:, :keep])  # all 64 levels of the kept frames
    assert not np.array_equal(grid_a.codes[:, keep:], grid0.codes[:, keep:])
    wav_a, _ = sf.read(io.BytesIO(fetch(site, a["job_id"], "wav")), dtype="int16")
    assert wav_a.shape == wav0.shape
    before = int(19.0 * rate)
    assert snr_db(wav0[:before], wav_a[:before]) >= 60.0
    assert snr_db(wav0[int(21 * rate) :], wav_a[int(21 * rate) :]) < 20.0  # the rest is a new take

    holder = site.workers[1].url
    slots = httpx.get(f"{holder}/health", timeout=10, verify=TLS).json()["kv_snapshots"]["slots"]
    assert [(s["origin"], s["tokens"]) for s in slots] == [(f"{job0}/0", tokens)]
    assert httpx.get(f"{site.workers[0].url}/health", timeout=10, verify=TLS).json()["kv_snapshots"]["slots"] == []

    # Retake B of the same prefix: both idle, worker 0 first in order, the holder preferred.
    site.wait_job(blocker, timeout=WAIT)
    wait_for(lambda: both_idle(site), timeout=60)
    b = site.wait_job(post(site, continue_from=cf, num_tracks=1, seed=12), timeout=WAIT)
    tb = b["tracks"][0]
    assert tb["worker_id"] == 1
    assert tb["metadata"]["prefill"]["tokens"] == tokens
    assert tb["metadata"]["prefill"]["restored"] == tokens  # its KV and its last hidden state: nothing prefilled
    assert tokens - tb["metadata"]["prefill"]["restored"] <= 0.1 * tokens  # prefilled: ≤ 10 % of the first's
    grid_b = codes.decode(fetch(site, b["job_id"], "codes"))
    assert np.array_equal(grid_b.codes[:, :keep], grid0.codes[:, :keep])

    # From an earlier point: the 20 s snapshot is cut to the 10 s prefix, never used past it.
    wait_for(lambda: both_idle(site), timeout=60)
    c = site.wait_job(post(site, continue_from={**cf, "at_sec": 10.0}, num_tracks=1, seed=13), timeout=WAIT)
    tc = c["tracks"][0]
    keep_c = int(10.0 * grid0.header["frame_rate"])
    assert tc["metadata"]["prefill"]["restored"] == tc["metadata"]["prefill"]["tokens"] - 1
    assert tc["metadata"]["prefill"]["tokens"] == tokens - 2 * (keep - keep_c)
    grid_c = codes.decode(fetch(site, c["job_id"], "codes"))
    assert np.array_equal(grid_c.codes[:, :keep_c], grid0.codes[:, :keep_c])
    assert not np.array_equal(grid_c.codes[:, keep_c:keep], grid0.codes[:, keep_c:keep])

    flac = fetch(site, a["job_id"], "render", format="flac", loudness=-20, end=19.0)
    x, r = sf.read(io.BytesIO(flac))
    assert abs(pyloudnorm.Meter(r).integrated_loudness(x) + 20) <= 0.5
    assert abs(x.shape[0] / r - 19.0) < 0.01


def test_a_repaint_goes_to_the_worker_that_made_its_original_and_decodes_only_its_changed_chunks(site):
    wait_for(lambda: both_idle(site), timeout=60)
    blocker = post(site, tags="jazz", lyrics="[verse]\nhold worker zero", duration=0.3, num_tracks=1, seed=19)
    wait_for(lambda: site.job(blocker)["tracks"][0]["worker_id"] == 0, timeout=30)
    made = site.wait_job(post(site, **SONG, num_tracks=1, seed=5), timeout=WAIT)
    assert made["status"] == "completed", made
    assert made["tracks"][0]["worker_id"] == 1
    job0 = made["job_id"]
    held = httpx.get(f"{site.workers[1].url}/health", timeout=10, verify=TLS).json()["kept_audio"]
    assert f"{job0}/0" in held["origins"]
    wav0, _ = sf.read(io.BytesIO(fetch(site, job0, "wav")), dtype="int16")

    site.wait_job(blocker, timeout=WAIT)
    wait_for(lambda: both_idle(site), timeout=60)
    cf = {"job_id": job0, "track_index": 0, "at_sec": 10.0, "end_sec": 14.0}
    edit = site.wait_job(post(site, continue_from=cf, num_tracks=1, seed=6), timeout=WAIT)
    assert edit["status"] == "completed", edit
    (t,) = edit["tracks"]
    assert t["worker_id"] == 1  # the holder of the original's audio, though worker 0 is first and idle
    span = t["metadata"]["repainted"]
    decoded, of = span["decoded_chunks"]
    assert 0 < decoded < of
    wav, _ = sf.read(io.BytesIO(fetch(site, edit["job_id"], "wav")), dtype="int16")
    first, last = span["changed_samples"]
    assert np.array_equal(wav[:first], wav0[:first])
    assert np.array_equal(wav[last:], wav0[last:])
    after = httpx.get(f"{site.workers[1].url}/health", timeout=10, verify=TLS).json()["kept_audio"]
    assert after["hits"] == held["hits"] + 1
