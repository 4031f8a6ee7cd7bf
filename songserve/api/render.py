"""Re-render a finished take from its stored WAV: another format, a loudness, a time range; cached on disk.

Why not regenerate: everything a download in another shape needs is in the 16-bit WAV the take
already has. ``GET /job/{id}/track/{i}/render?format=flac|opus|mp3|wav&loudness=-14&start=&end=``:

- ``format``: FLAC (16-bit), Opus (in Ogg, at 48 kHz: Opus has no 44.1 kHz mode, so the audio is
  resampled 160/147 with a polyphase filter), MP3 (libsndfile's encoder, as export writes it), WAV;
  all through ``soundfile`` (libsndfile). Every one of them carries the take's title and, as
  its comment, the lyrics (FLAC and Opus as Vorbis comments, MP3 as ID3, WAV as RIFF INFO).
- ``loudness``: integrated loudness in LUFS (EBU R128 / ITU-R BS.1770-4, measured with
  ``pyloudnorm``), from -70 to -5; one gain for the whole selection. The gain never clips: when
  reaching the target would push a sample over -1 dBFS the gain stops there, and the answer says
  so (``X-Render-Limited: true``, ``X-Render-Loudness``: the loudness reached). Unset: unchanged.
- ``start``, ``end``: seconds of the take (default: all of it).

Renders are cached in the job's results folder (``track_<i>.render-<key>.<ext>`` with a JSON
beside it holding what the headers say), so retention removes them with the job; at most
``MAX_RENDERS`` per track are kept, the oldest go first. Bad parameters are 422 naming the field.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import secrets
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf

from songserve import __version__
from songserve.api.artifacts import ArtifactStore
from songserve.errors import FieldError

log = logging.getLogger(__name__)

# format → (libsndfile container, subtype, media type)
FORMATS = {
    "flac": ("FLAC", "PCM_16", "audio/flac"),
    "opus": ("OGG", "OPUS", "audio/ogg"),
    "mp3": ("MP3", "MPEG_LAYER_III", "audio/mpeg"),
    "wav": ("WAV", "PCM_16", "audio/wav"),
}
LOUDNESS_RANGE = (-70.0, -5.0)  # LUFS
CEILING_DBFS = -1.0  # the highest sample peak a loudness gain may reach
OPUS_RATE = 48_000
MIN_MEASURED_SEC = 0.4  # BS.1770's gating block: a shorter selection has no integrated loudness
MAX_RENDERS = 16  # cached renders per track


@dataclass(frozen=True)
class RenderSpec:
    """What a render is, once checked: its cache key is the hash of these fields."""

    format: str
    loudness: float | None  # LUFS, to 0.1
    start: float  # seconds, to the millisecond
    end: float

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]

    def filename(self, job_id: str, idx: int, duration: float) -> str:
        """The download's name says what it is: ``<job>_track0_-14LUFS_0-30s.flac``; two renders of one
        take at another loudness or range never share a name in a downloads folder."""
        name = f"{job_id}_track{idx}"
        if self.loudness is not None:
            name += f"_{self.loudness:g}LUFS"
        if self.start > 0 or self.end < round(duration, 3):
            name += f"_{self.start:g}-{self.end:g}s"
        return f"{name}.{self.format}"


def _finite(name: str, value: float | None) -> float | None:
    if value is not None and not math.isfinite(value):
        raise FieldError(name, "must be a finite number", where="query")
    return value


def parse(fmt: str, loudness: float | None, start: float | None, end: float | None, duration: float) -> RenderSpec:
    """The query's parameters for a take of ``duration`` seconds, or a 422 naming the field."""
    if fmt not in FORMATS:
        raise FieldError("format", f"must be one of {', '.join(FORMATS)}", where="query")
    low, high = LOUDNESS_RANGE
    loudness = _finite("loudness", loudness)
    if loudness is not None and not low <= loudness <= high:
        raise FieldError("loudness", f"must be between {low:g} and {high:g} LUFS", where="query")
    a = _finite("start", start) or 0.0
    b = _finite("end", end)
    b = duration if b is None else b
    if not 0 <= a < duration:
        raise FieldError("start", f"must be from 0 to below the take's {duration:.3f} s", where="query")
    if not a < b <= duration + 1e-3:
        raise FieldError("end", f"must be after start and at most the take's {duration:.3f} s", where="query")
    return RenderSpec(fmt, None if loudness is None else round(loudness, 1), round(a, 3), round(min(b, duration), 3))


@dataclass(frozen=True)
class Rendered:
    path: Path
    media_type: str
    info: dict[str, Any]  # measured, reached, gain_db, limited (with a loudness)

    def headers(self) -> dict[str, str]:
        if "reached" not in self.info:
            return {}
        return {
            "X-Render-Loudness": f"{self.info['reached']:.2f}",
            "X-Render-Gain-Db": f"{self.info['gain_db']:.2f}",
            "X-Render-Limited": "true" if self.info["limited"] else "false",
        }


def _loudness_gain(x: np.ndarray, rate: int, target: float) -> tuple[np.ndarray, dict[str, Any]]:
    """x (samples, channels) at ``target`` LUFS, or as near as the ceiling lets it."""
    import pyloudnorm  # scipy underneath: loaded by the first render, not at start-up

    if x.shape[0] < MIN_MEASURED_SEC * rate:
        raise FieldError("loudness", f"needs at least {MIN_MEASURED_SEC} s of audio to measure", where="query")
    measured = float(pyloudnorm.Meter(rate).integrated_loudness(x))
    if not math.isfinite(measured):
        raise FieldError("loudness", "cannot be measured: the selection is silent", where="query")
    gain_db = target - measured
    peak = float(np.abs(x).max())
    limited = peak > 0 and 20 * math.log10(peak) + gain_db > CEILING_DBFS
    if limited:
        gain_db = CEILING_DBFS - 20 * math.log10(peak)
    info = {"measured": round(measured, 2), "gain_db": round(gain_db, 2), "target": target, "limited": limited}
    info["reached"] = round(measured + gain_db, 2)
    return (x * 10 ** (gain_db / 20)).astype(np.float32), info


def render_file(wav: Path, out: Path, spec: RenderSpec, title: str, lyrics: str) -> dict[str, Any]:
    """Write ``spec``'s render of ``wav`` to ``out`` (a temporary name, then a rename); returns its info.

    Blocking (decoding, filtering, encoding): the service runs it in a thread."""
    with sf.SoundFile(wav) as f:
        rate = f.samplerate
        f.seek(int(round(spec.start * rate)))
        x = f.read(int(round((spec.end - spec.start) * rate)), dtype="float32", always_2d=True)
    info: dict[str, Any] = {}
    if spec.loudness is not None:
        x, info = _loudness_gain(x, rate, spec.loudness)
    container, subtype, _ = FORMATS[spec.format]
    if spec.format == "opus" and rate != OPUS_RATE:
        from scipy.signal import resample_poly

        g = math.gcd(OPUS_RATE, rate)
        x = resample_poly(x, OPUS_RATE // g, rate // g, axis=0).astype(np.float32)
        rate = OPUS_RATE
    x = np.clip(x, -1.0, 1.0)  # the resampler's ripple may overshoot by a hair
    tmp = out.with_name(f".{out.name}.{secrets.token_hex(3)}.tmp")
    try:
        with sf.SoundFile(tmp, "w", rate, x.shape[1], subtype, format=container) as f:
            f.title = title
            f.comment = lyrics
            f.software = f"songserve {__version__}"
            f.write(x)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return info


class Renders:
    """The cache of one results folder's renders."""

    def __init__(self, artifacts: ArtifactStore) -> None:
        self.artifacts = artifacts

    def cached(self, job_id: str, index: int, spec: RenderSpec) -> Rendered | None:
        path = self.artifacts.render_path(job_id, index, spec.key(), spec.format)
        side = self.artifacts.render_path(job_id, index, spec.key(), "json")
        if not (path.is_file() and side.is_file()):
            return None
        try:
            info = json.loads(side.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return Rendered(path, FORMATS[spec.format][2], info)

    def make(self, job_id: str, index: int, spec: RenderSpec, title: str, lyrics: str) -> Rendered:
        """Render into the cache (blocking), then drop the track's oldest renders over ``MAX_RENDERS``."""
        wav = self.artifacts.path(job_id, index, "wav")
        path = self.artifacts.render_path(job_id, index, spec.key(), spec.format)
        info = render_file(wav, path, spec, title, lyrics)
        side = self.artifacts.render_path(job_id, index, spec.key(), "json")
        side.write_text(json.dumps(info), encoding="utf-8")
        audio = [p for p in self.artifacts.renders(job_id, index) if not p.name.endswith(".json")]
        for old in audio[: max(0, len(audio) - MAX_RENDERS)]:
            old.unlink(missing_ok=True)
            old.with_suffix(".json").unlink(missing_ok=True)
        log.info("job %s track %d: rendered %s (%s)", job_id, index, path.name, info or "no loudness change")
        return Rendered(path, FORMATS[spec.format][2], info)
