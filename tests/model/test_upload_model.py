"""An upload through a real dispatcher and a real model worker on the release-shaped tiny set.

What an upload must do, end to end over HTTP:
- ``GET /uploads/{id}/codes`` of a stereo 44.1 kHz WAV is the code grid of a straightforward encoder
  written in the tests (torch's weight_norm, float64 distances: ``test_encoder.py``) on the same
  checkpoint: the same frames, every code equal but for float near-ties (the share is printed;
  ``bench/encoder_vs_reference.py --url`` compares the reference's own ``DacRVQ.encode`` the same way);
- two takes continued from the 8 s upload at its end keep its codes, all 64 levels, for the kept
  frames, and their audio before 7 s is the decode of the upload's codes (SNR ≥ 60 dB);
- a second continuation of the same prefix restores the KV snapshot the first one left.
"""

from __future__ import annotations

import io

import httpx
import numpy as np
import pytest
import soundfile as sf
import torch

from songserve.audio import codes
from songserve.audio.reading import read_audio
from songserve.pipeline.stages.codec import load_decoder
from songserve.pipeline.tiny.build import RELEASE_LAYOUT
from songserve.pipeline.tiny.decoder_release import ReleaseDecoderSizes
from tests.support.audio import music, wav_bytes
from tests.support.http import TLS
from tests.support.plain_encoder import plain_codes
from tests.support.servers import Cluster, wait_for
from tests.support.tiny_site import tiny_site

WAIT = 600.0  # seconds: generous, the machine is shared


@pytest.fixture(scope="module")
def site(shared_release, tmp_path_factory):
    with tiny_site(shared_release, tmp_path_factory.mktemp("upload_model")) as c:
        yield c  # the process's worker on the release-shaped set, its KV snapshots cleared (tests/support/tiny_site.py)


@pytest.fixture(scope="module")
def uploaded(site):
    """An 8 s stereo 44.1 kHz WAV, uploaded and encoded: (its bytes, its upload view)."""
    data = wav_bytes(music(8.0))
    r = httpx.post(f"{site.url}/uploads", files={"file": ("demo.wav", data, "audio/wav")}, timeout=60, verify=TLS)
    assert r.status_code == 200, r.text
    upload_id = r.json()["upload_id"]
    view = wait_for(
        lambda: (
            (v := httpx.get(f"{site.url}/uploads/{upload_id}", timeout=10, verify=TLS).json())["status"] != "queued"
            and v["status"] != "encoding"
            and v
        ),
        timeout=WAIT,
    )
    assert view["status"] == "ready", view
    return data, view


def fetch(site: Cluster, path: str) -> bytes:
    r = httpx.get(f"{site.url}{path}", timeout=60, verify=TLS)
    assert r.status_code == 200, r.text
    return r.content


def snr_db(reference: np.ndarray, other: np.ndarray) -> float:
    noise = float(((reference.astype(np.float64) - other) ** 2).sum())
    return float("inf") if noise == 0 else 10 * np.log10(float((reference.astype(np.float64) ** 2).sum()) / noise)


def test_the_uploads_codes_are_the_plain_encoders_on_the_release_files(site, release_dir, uploaded):
    data, view = uploaded
    grid = codes.decode(fetch(site, view["codes"]))
    pcm, _ = read_audio(data)
    plain = plain_codes(ReleaseDecoderSizes(), release_dir / RELEASE_LAYOUT["decoder_checkpoint"], pcm)
    assert grid.codes.shape == plain.shape == (64, 172)
    assert view["frames"] == 172
    share = float((grid.codes == plain).mean())
    print(f"GET /uploads/{{id}}/codes equal to the plain float64 encoder: {share:.6f}")
    assert share >= 0.99
    assert grid.header["upload_id"] == view["upload_id"]
    assert grid.header["source"]["sample_rate"] == 44100


def test_takes_continued_from_the_upload_keep_it_and_a_second_restores_its_snapshot(site, release_dir, uploaded):
    _, view = uploaded
    kept = codes.decode(fetch(site, view["codes"]))
    body = {
        "continue_from": {"upload_id": view["upload_id"]},
        "tags": "pop",
        "lyrics": "[verse]\non and on",
        "duration": 10 / 60,
        "num_tracks": 2,
        "seed": 3,
    }
    r = httpx.post(f"{site.url}/generate", json=body, timeout=30, verify=TLS)
    assert r.status_code == 200, r.text
    done = site.wait_job(r.json()["job_id"], timeout=WAIT)
    assert done["status"] == "completed", done

    decoder = load_decoder(
        release_dir / RELEASE_LAYOUT["decoder_config"],
        release_dir / RELEASE_LAYOUT["decoder_checkpoint"],
        torch.device("cpu"),
    )
    wave = decoder.decode(torch.from_numpy(kept.codes.astype(np.int64))[None], chunk_frames=0)[0].t().numpy()
    expected = np.clip(wave, -1.0, 1.0)  # as every WAV is written (export.py)
    before = int(7.0 * 44100)
    tokens = None
    for t in done["tracks"]:
        grid = codes.decode(fetch(site, t["files"]["codes"]))
        assert np.array_equal(grid.codes[:, : kept.frames], kept.codes)  # all 64 levels of the kept frames
        assert grid.frames > kept.frames
        wav, rate = sf.read(io.BytesIO(fetch(site, t["files"]["wav"])), dtype="float32")
        assert rate == 44100
        snr = snr_db(expected[:before], wav[:before])
        print(f"take {t['index']}: audio before 7 s against the decode of the upload's codes: {snr:.1f} dB")
        assert snr >= 60.0
        assert t["metadata"]["continued"]["origin"] == f"upload/{view['upload_id']}"
        assert t["metadata"]["batch_size"] == 2  # one batch: the prefix prefilled once
        tokens = t["metadata"]["prefill"]["tokens"]
        assert tokens == t["metadata"]["tokens"]["backbone_prompt"] + 2 * kept.frames

    r = httpx.post(f"{site.url}/generate", json={**body, "num_tracks": 1, "seed": 4}, timeout=30, verify=TLS)
    again = site.wait_job(r.json()["job_id"], timeout=WAIT)["tracks"][0]
    assert again["metadata"]["prefill"]["tokens"] == tokens
    assert again["metadata"]["prefill"]["restored"] == tokens  # the first one's snapshot: nothing prefilled
    slots = httpx.get(f"{site.workers[0].url}/health", timeout=10, verify=TLS).json()["kv_snapshots"]["slots"]
    assert [s["origin"] for s in slots] == [f"upload/{view['upload_id']}"]
