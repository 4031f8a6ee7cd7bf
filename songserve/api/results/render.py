"""Re-render a finished take from its stored WAV: another format, a loudness, a time range; cached on disk.

Why not regenerate: everything a download in another shape needs is in the 16-bit WAV the take
already has. ``GET /job/{id}/track/{i}/render?format=flac|opus|mp3|wav&loudness=-14&start=&end=``:

- ``format``: FLAC (16-bit), Opus (in Ogg, at 48 kHz: Opus has no 44.1 kHz mode, so the audio is
  resampled with libsoxr), MP3 (libsndfile's encoder, as export writes it), WAV; all through
  ``soundfile`` (libsndfile). Every one of them carries the take's title and, as its comment, the
  lyrics (FLAC and Opus as Vorbis comments, MP3 as ID3, WAV as RIFF INFO); an instrumental has no
  lyrics, so no comment (libsndfile refuses an empty tag: the render would be a 500).
- ``loudness``: integrated loudness in LUFS (EBU R128 / ITU-R BS.1770-4, measured with
  ``pyloudnorm``), from -70 to -5; one gain for the whole selection. The gain never clips: when
  reaching the target would push a sample over -1 dBFS the gain stops there, and the answer says
  so (``X-Render-Limited: true``, ``X-Render-Loudness``: the loudness reached). Unset: unchanged.
- ``start``, ``end``: seconds of the take (default: all of it).

Renders are cached in the job's results folder (``track_<i>.render-<key>.<ext>`` with a JSON
beside it holding what the headers say), so retention removes them with the job; at most
``MAX_RENDERS`` per track are kept, the oldest go first. Bad parameters are 422 naming the field.

Renders are bounded (left unbounded, 60 at once cost +1.3 GiB and both cores, and slowed uploads to 14-21 s
because they filled the executor uploads, live MP3 and file relays share): ``RENDER_CONCURRENCY`` run
at once on threads of their own, ``RENDER_QUEUE`` more wait, identical requests share the render
under way, the rest get 429 with a Retry-After; each render holds one block of audio at a time
(``results/render_audio.py``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import os
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import soundfile as sf

from songserve import __version__
from songserve.api.results import render_audio
from songserve.api.results.artifacts import ArtifactStore
from songserve.api.results.render_audio import Measured
from songserve.errors import FieldError, SongserveError

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
    spec = RenderSpec(fmt, None if loudness is None else round(loudness, 1), round(a, 3), round(min(b, duration), 3))
    if loudness is not None and spec.end - spec.start < MIN_MEASURED_SEC:
        raise FieldError("loudness", f"needs at least {MIN_MEASURED_SEC} s of audio to measure", where="query")
    return spec


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


def _gain(measured: Measured, target: float) -> tuple[float, dict[str, Any]]:
    """The one gain (dB) that takes the selection to ``target`` LUFS, or as near as the ceiling lets it."""
    if not math.isfinite(measured.loudness):
        raise FieldError("loudness", "cannot be measured: the selection is silent", where="query")
    gain_db = target - measured.loudness
    peak = measured.peak
    limited = peak > 0 and 20 * math.log10(peak) + gain_db > CEILING_DBFS
    if limited:
        gain_db = CEILING_DBFS - 20 * math.log10(peak)
    info = {"measured": round(measured.loudness, 2), "gain_db": round(gain_db, 2), "target": target}
    info.update(limited=limited, reached=round(measured.loudness + gain_db, 2))
    return gain_db, info


def render_file(wav: Path, out: Path, spec: RenderSpec, title: str, lyrics: str) -> dict[str, Any]:
    """Write ``spec``'s render of ``wav`` to ``out`` (a temporary name, then a rename); returns its info.

    Blocking (decoding, filtering, encoding): ``Renders`` runs it on its own threads. Block by block
    (``results/render_audio.py``): a loudness is measured in one pass, then the selection is written in another.
    An empty title or lyrics (an instrumental) is left out of the tags: libsndfile refuses an empty one."""
    info: dict[str, Any] = {}
    container, subtype, _ = FORMATS[spec.format]
    with sf.SoundFile(wav) as f:
        rate = f.samplerate
        first = int(round(spec.start * rate))
        frames = int(round((spec.end - spec.start) * rate))
        gain_db = 0.0
        if spec.loudness is not None:
            gain_db, info = _gain(render_audio.measure(f, first, frames, loudness=True), spec.loudness)
        tags = {"title": title, "comment": lyrics, "software": f"songserve {__version__}"}
        output = render_audio.Output(
            container, subtype, OPUS_RATE if spec.format == "opus" else rate, 10 ** (gain_db / 20), tags
        )
        tmp = out.with_name(f".{out.name}.{secrets.token_hex(3)}.tmp")
        try:
            render_audio.write(f, first, frames, tmp, output)
            os.replace(tmp, out)
        finally:
            tmp.unlink(missing_ok=True)
    return info


class RendersBusy(SongserveError):
    """More different renders asked at once than run and wait (HTTP 429, with a Retry-After)."""

    http_status = 429

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.headers = {"Retry-After": str(retry_after)}


class Renders:
    """The cache of one results folder's renders, and the renders being made.

    ``concurrency`` renders run at once on threads of their own (never the executor uploads, live
    MP3 and file relays share), ``queue`` more wait for one; a request for a render already being
    made waits for that one instead of making it again, and takes no place in line. Beyond: 429
    with a Retry-After from the recent renders' pace."""

    def __init__(self, artifacts: ArtifactStore, concurrency: int = 2, queue: int = 16) -> None:
        self.artifacts = artifacts
        self.concurrency, self.queue = concurrency, queue
        self._executor = ThreadPoolExecutor(concurrency, thread_name_prefix="render")
        self._making: dict[str, asyncio.Future[Rendered]] = {}  # job/track/key → the render under way
        self._evicting = threading.Lock()
        self._pace = 2.0  # seconds a recent render took (a moving average): the Retry-After's base

    async def get(self, job_id: str, index: int, spec: RenderSpec, title: str, lyrics: str) -> Rendered:
        """The render from the cache, or the one being made, or a new one once a thread is free."""
        got = self.cached(job_id, index, spec)
        if got is not None:
            return got
        key = f"{job_id}/{index}/{spec.key()}"
        making = self._making.get(key)
        if making is None:
            if len(self._making) >= self.concurrency + self.queue:
                retry = max(1, min(60, math.ceil(self._pace * len(self._making) / self.concurrency)))
                log.info("job %s track %d: render refused, %d being made or waiting", job_id, index, len(self._making))
                raise RendersBusy(
                    f"{len(self._making)} renders are being made or waiting (RENDER_CONCURRENCY "
                    f"{self.concurrency} + RENDER_QUEUE {self.queue}); try again in {retry} s.",
                    retry,
                )
            loop = asyncio.get_running_loop()
            making = loop.run_in_executor(self._executor, self.make, job_id, index, spec, title, lyrics)
            self._making[key] = making
            making.add_done_callback(lambda done: self._finished(key, done))
        return await asyncio.shield(making)  # a client that goes away leaves the render to the others

    def _finished(self, key: str, done: asyncio.Future[Rendered]) -> None:
        self._making.pop(key, None)
        if not done.cancelled():
            done.exception()  # read: a render no one waits for any more must not log "never retrieved"

    def close(self) -> None:
        """At shutdown: renders not started are dropped (their requests are gone with the server)."""
        self._executor.shutdown(wait=False, cancel_futures=True)

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
        t0 = time.monotonic()
        wav = self.artifacts.path(job_id, index, "wav")
        path = self.artifacts.render_path(job_id, index, spec.key(), spec.format)
        try:
            info = render_file(wav, path, spec, title, lyrics)
        finally:  # the pace Retry-After is reckoned from, failed renders included
            self._pace = 0.7 * self._pace + 0.3 * (time.monotonic() - t0)
        side = self.artifacts.render_path(job_id, index, spec.key(), "json")
        side.write_text(json.dumps(info), encoding="utf-8")
        with self._evicting:  # one thread at a time: another's unlink between a listing and its stat raised
            audio = [p for p in self.artifacts.renders(job_id, index) if not p.name.endswith(".json")]
            for old in audio[: max(0, len(audio) - MAX_RENDERS)]:
                old.unlink(missing_ok=True)
                old.with_suffix(".json").unlink(missing_ok=True)
        what = f"{spec.format}, {spec.loudness} LUFS" if spec.loudness is not None else spec.format
        log.info(
            "job %s track %d: rendered %s (%s, %.3f-%.3f s) in %.2f s: %s",
            job_id,
            index,
            path.name,
            what,
            spec.start,
            spec.end,
            time.monotonic() - t0,
            info or "no loudness change",
        )
        return Rendered(path, FORMATS[spec.format][2], info)
