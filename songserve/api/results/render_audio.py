"""A render's audio work block by block: one pass measures the selection, one writes it.

Why blocks: a render read whole held the selection as float32 and again as every filtering copy
(a 3-minute take: hundreds of MB per render, and renders ran side by side). Here a render holds one
block of ``BLOCK_SEC`` and, for a loudness, one sum per channel per 100 ms, whatever the length.

The measurement is ITU-R BS.1770-4's integrated loudness, as running sums: the K-weighting (a high
shelf, +4 dB above ~1.5 kHz, then a high pass at 38 Hz; biquads of the audio-EQ cookbook, their
state carried from block to block), the mean square of every 400 ms block every 100 ms, an
absolute gate at -70 LUFS and a relative one 10 LU under the gated mean. ``pyloudnorm`` measures
the same from a whole array; ``tests/unit/test_render_audio.py`` checks the two agree.

Opus has no 44.1 kHz mode: its render is resampled to 48 kHz by libsoxr's streaming resampler,
block by block with its state carried, so the blocks join without a seam.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf

BLOCK_SEC = 1.6  # a multiple of the 100 ms hop: the measurement's sums never straddle two blocks
GATE_ABSOLUTE = -70.0  # LUFS
GATE_RELATIVE = -10.0  # LU under the absolutely gated mean
CHANNEL_WEIGHTS = (1.0, 1.0, 1.0, 1.41, 1.41)  # BS.1770: L, R, C, Ls, Rs (more channels weigh 1)


@dataclass(frozen=True)
class Measured:
    loudness: float  # LUFS; -inf when no 400 ms block is over the gates (silence, or under 0.4 s)
    peak: float  # the highest absolute sample


def blocks(f: sf.SoundFile, first: int, frames: int) -> Iterator[np.ndarray]:
    """Frames [first, first + frames) of ``f`` as float32 (n, channels) blocks of ``BLOCK_SEC``."""
    size = max(1, round(BLOCK_SEC * f.samplerate))
    f.seek(first)
    left = frames
    while left > 0:
        x = f.read(min(size, left), dtype="float32", always_2d=True)
        if not len(x):
            return
        left -= len(x)
        yield x


def _biquad(kind: str, gain_db: float, q: float, fc: float, rate: int) -> tuple[np.ndarray, np.ndarray]:
    """An audio-EQ-cookbook biquad (b, a), normalised so a[0] = 1."""
    amp = 10 ** (gain_db / 40)
    w0 = 2 * math.pi * fc / rate
    cos, alpha = math.cos(w0), math.sin(w0) / (2 * q)
    if kind == "high_shelf":
        root = 2 * math.sqrt(amp) * alpha
        b = [
            amp * ((amp + 1) + (amp - 1) * cos + root),
            -2 * amp * ((amp - 1) + (amp + 1) * cos),
            amp * ((amp + 1) + (amp - 1) * cos - root),
        ]
        a = [(amp + 1) - (amp - 1) * cos + root, 2 * ((amp - 1) - (amp + 1) * cos), (amp + 1) - (amp - 1) * cos - root]
    else:  # high pass
        b = [(1 + cos) / 2, -(1 + cos), (1 + cos) / 2]
        a = [1 + alpha, -2 * cos, 1 - alpha]
    return np.array(b) / a[0], np.array(a) / a[0]


def k_weighting(rate: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """BS.1770's K-weighting at ``rate``: the shelf, then the high pass."""
    return [_biquad("high_shelf", 4.0, 1 / math.sqrt(2), 1500.0, rate), _biquad("high_pass", 0.0, 0.5, 38.0, rate)]


def measure(f: sf.SoundFile, first: int, frames: int, loudness: bool) -> Measured:
    """The selection's peak and, when asked, its integrated loudness: one pass, bounded memory."""
    from scipy.signal import lfilter  # loaded by the first render that measures, not at start-up

    rate, channels = f.samplerate, f.channels
    hop = max(1, round(rate / 10))
    filters = k_weighting(rate)
    states = [np.zeros((2, channels)) for _ in filters]
    sums: list[np.ndarray] = []  # per 100 ms: each channel's sum of squares after the K-weighting
    carry = np.zeros((0, channels))
    peak = 0.0
    for x in blocks(f, first, frames):
        peak = max(peak, float(np.abs(x).max()))
        if not loudness:
            continue
        y = x.astype(np.float64)
        for i, (b, a) in enumerate(filters):
            y, states[i] = lfilter(b, a, y, axis=0, zi=states[i])
        if carry.size:
            y = np.concatenate([carry, y])
        whole = y.shape[0] // hop * hop
        sums.append(np.square(y[:whole]).reshape(-1, hop, channels).sum(axis=1))
        carry = y[whole:]
    return Measured(_gated(np.concatenate(sums) if sums else np.zeros((0, channels)), hop), peak)


def _gated(sums: np.ndarray, hop: int) -> float:
    """Integrated loudness from per-100 ms sums of squares (n, channels): 400 ms blocks, both gates."""
    if sums.shape[0] < 4:
        return -math.inf
    ms = (sums[:-3] + sums[1:-2] + sums[2:-1] + sums[3:]) / (4 * hop)  # each 400 ms block's mean square
    weights = np.array([CHANNEL_WEIGHTS[i] if i < len(CHANNEL_WEIGHTS) else 1.0 for i in range(sums.shape[1])])
    power = ms @ weights
    with np.errstate(divide="ignore"):
        level = -0.691 + 10 * np.log10(power)
    kept = level >= GATE_ABSOLUTE
    if not kept.any():
        return -math.inf
    relative = -0.691 + 10 * math.log10(float(power[kept].mean())) + GATE_RELATIVE
    kept &= level > relative
    return -0.691 + 10 * math.log10(float(power[kept].mean())) if kept.any() else -math.inf


@dataclass(frozen=True)
class Output:
    """What a render writes: libsndfile's container and subtype, its rate, the gain and the tags."""

    container: str
    subtype: str
    rate: int
    gain: float  # linear
    tags: dict[str, str]  # libsndfile's names (title, comment, software); an empty value is not written


def write(src: sf.SoundFile, first: int, frames: int, out: Path, spec: Output) -> None:
    """Frames [first, first + frames) of ``src`` to ``out``: the gain, a resampling to ``spec.rate``,
    a clip to [-1, 1] (the resampler's ripple may overshoot by a hair), block by block."""
    import soxr  # the uploads' resampler too

    channels = src.channels
    stream = None
    if spec.rate != src.samplerate:
        stream = soxr.ResampleStream(src.samplerate, spec.rate, channels, dtype="float32", quality="HQ")
    with sf.SoundFile(out, "w", spec.rate, channels, spec.subtype, format=spec.container) as f:
        for name, value in spec.tags.items():
            if value.strip():  # libsndfile refuses an empty string ("bad string"): an instrumental has no lyrics
                setattr(f, name, value)
        for x in blocks(src, first, frames):
            if spec.gain != 1.0:
                x *= np.float32(spec.gain)
            if stream is not None:
                x = stream.resample_chunk(x)
            f.write(np.clip(x, -1.0, 1.0, out=x))
        if stream is not None:
            tail = stream.resample_chunk(np.zeros((0, channels), dtype=np.float32), last=True)
            f.write(np.clip(tail, -1.0, 1.0, out=tail))
