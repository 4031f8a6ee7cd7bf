"""Audio the tests make: a few tones with noise, its bytes in a file format (what an upload sends), and a
take's WAV rewritten as noise no loudness target can reach."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import soundfile as sf


def music(seconds: float, rate: int = 44100, channels: int = 2, seed: int = 3) -> np.ndarray:
    """A few tones and some noise, (frames, channels) float in [-1, 1]."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    cols = [sum(0.2 * np.sin(2 * np.pi * f * (c + 1) * t + c) for f in (110, 220, 330)) for c in range(channels)]
    return np.clip(np.stack(cols, 1) + 0.05 * rng.standard_normal((t.size, channels)), -1, 1)


def wav_bytes(x: np.ndarray, rate: int = 44100, fmt: str = "WAV", subtype: str | None = "PCM_16") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, x, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def spiky(wav: Path) -> None:
    """Rewrite a take's WAV, same length, as quiet noise with sparse peaks: no gain takes it to -14 LUFS
    without a peak past -1 dBFS (a tone reaches any target in the range)."""
    info = sf.info(wav)
    x = 0.01 * np.random.default_rng(0).standard_normal((info.frames, info.channels))
    x[:: info.samplerate // 10] = 0.9
    sf.write(wav, x, info.samplerate, subtype="PCM_16")
