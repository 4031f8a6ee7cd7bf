"""The render's block-by-block audio work (``results/render_audio.py``) against whole-array references, in-process.

What is proved: the running BS.1770 measurement is pyloudnorm's integrated loudness (to 0.01 LU) for
selections that span many blocks, start mid-file, are gated by silence or are too short to measure;
a block-wise write with a gain is the whole-array product sample for sample; an Opus render resampled
block by block has the length and loudness of its source (no seam, no lost tail).
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np
import pyloudnorm
import pytest
import soundfile as sf

from songserve.api.results import render_audio

RATE = 44100


def signal(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * RATE)) / RATE
    left = 0.3 * np.sin(2 * np.pi * 220 * t) * (1 + 0.5 * np.sin(0.7 * t))
    right = 0.1 * rng.standard_normal(t.size) + 0.2 * np.sin(2 * np.pi * 3000 * t)
    return np.stack([left, right], axis=1)


def wav(tmp: Path, x: np.ndarray) -> Path:
    path = tmp / "in.wav"
    sf.write(path, x, RATE, subtype="FLOAT")
    return path


@pytest.mark.parametrize(("seconds", "start", "quiet"), [(7.3, 0.0, False), (12.0, 2.35, True), (0.45, 0.0, False)])
def test_the_running_measurement_is_pyloudnorms(tmp_path, seconds, start, quiet):
    x = signal(seconds + start, seed=1)
    if quiet:
        x[int((start + 3) * RATE) : int((start + 7) * RATE)] *= 1e-4  # gated out: absolute, then relative
    first = int(start * RATE)
    with sf.SoundFile(wav(tmp_path, x)) as f:
        got = render_audio.measure(f, first, x.shape[0] - first, loudness=True)
    sel = x[first:].astype(np.float32).astype(np.float64)
    assert abs(got.loudness - pyloudnorm.Meter(RATE).integrated_loudness(sel)) < 0.01
    assert got.peak == pytest.approx(float(np.abs(sel).max()), rel=1e-6)


def test_silence_and_a_selection_under_one_gating_block_measure_minus_infinity(tmp_path):
    with sf.SoundFile(wav(tmp_path, np.zeros((RATE * 2, 2)))) as f:
        assert render_audio.measure(f, 0, RATE * 2, loudness=True).loudness == -math.inf
    with sf.SoundFile(wav(tmp_path, signal(2.0, seed=2))) as f:
        assert render_audio.measure(f, 0, int(0.3 * RATE), loudness=True).loudness == -math.inf


def test_a_block_wise_write_with_a_gain_is_the_whole_array_product(tmp_path):
    x = signal(5.0, seed=3)
    gain = 10 ** (-6 / 20)
    out = tmp_path / "out.wav"
    spec = render_audio.Output("WAV", "FLOAT", RATE, gain, {"title": "t", "comment": ""})
    with sf.SoundFile(wav(tmp_path, x)) as f:
        render_audio.write(f, RATE, 3 * RATE, out, spec)
    y, _ = sf.read(out, dtype="float32")
    assert np.array_equal(y, np.clip(x[RATE : 4 * RATE].astype(np.float32) * np.float32(gain), -1, 1))
    tags = sf.SoundFile(out).copy_metadata()
    assert tags["title"] == "t"
    assert "comment" not in tags  # an empty value is left out (libsndfile refuses it)


def test_an_opus_render_resampled_block_by_block_keeps_its_length_and_loudness(tmp_path):
    x = signal(6.0, seed=4)
    out = tmp_path / "out.ogg"
    with sf.SoundFile(wav(tmp_path, x)) as f:
        render_audio.write(f, 0, x.shape[0], out, render_audio.Output("OGG", "OPUS", 48_000, 1.0, {}))
    y, rate = sf.read(io.BytesIO(out.read_bytes()))
    assert rate == 48_000
    assert abs(y.shape[0] / rate - 6.0) < 0.03
    meter = pyloudnorm.Meter(rate)
    assert abs(meter.integrated_loudness(y) - pyloudnorm.Meter(RATE).integrated_loudness(x)) < 0.3
