"""Audio for ``GET /v1/audio?path=``: opaque ids of this server's takes, never a filesystem path.

ACE-Step puts the absolute server path of each file in ``path`` and serves whatever lies under its
audio folder. Here ``path`` is an id, ``<job id>-<take index>.<format>`` (``3f2a…-0.mp3``), that names
one take of one job and its format; the file is found through the ``JobService`` (the same checks as
``/job/{id}/track/{i}/mp3``: done, present, of its recorded size), so nothing else on the disk can be
named. Anything that is not such an id is 403; an id of no finished take is 404.

A take exists as WAV and MP3; FLAC (ACE-Step's third format) is encoded from the WAV on first
request, beside it in the job's results folder, so retention removes it with the job. The encoding
streams in blocks (a ten-minute stereo take is ~100 MB of WAV) on a thread, written under a temporary
name and renamed, so a reader never sees half a file.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, quote, urlsplit

import soundfile as sf

from songserve.api.acestep.failures import AceError
from songserve.api.service.job_service import JobService
from songserve.api.service.keys import Caller
from songserve.errors import SongserveError

FORMATS = ("mp3", "wav", "flac")
MEDIA = {"mp3": "audio/mpeg", "wav": "audio/wav", "flac": "audio/flac"}
AUDIO_ID = re.compile(r"^([a-f0-9]{8,64})-(\d{1,4})\.(mp3|wav|flac)$")
ROUTE = "/v1/audio"
BLOCK_FRAMES = 1 << 16


@dataclass(frozen=True)
class AudioRef:
    job_id: str
    index: int
    fmt: str

    @property
    def id(self) -> str:
        return f"{self.job_id}-{self.index}.{self.fmt}"

    @property
    def url(self) -> str:
        """The relative URL ACE-Step's clients join to their base URL (the Studio does)."""
        return f"{ROUTE}?path={quote(self.id, safe='')}"


def parse_id(text: str) -> AudioRef | None:
    m = AUDIO_ID.fullmatch(text)
    return AudioRef(m.group(1), int(m.group(2)), m.group(3)) if m else None


def parse_source(value: str) -> AudioRef | None:
    """A ``src_audio_path`` as a client sends back what it got: the id, ``/v1/audio?path=<id>``, or
    that URL joined to any base URL."""
    text = value.strip()
    ref = parse_id(text)
    if ref is not None:
        return ref
    parts = urlsplit(text)
    if not parts.path.endswith(ROUTE):
        return None
    given = parse_qs(parts.query).get("path", [])
    return parse_id(given[0]) if len(given) == 1 else None


async def audio_file(svc: JobService, path: str, caller: Caller | None = None) -> tuple[Path, str]:
    """The file and media type of ``/v1/audio?path=``; 403 for what is not an id, 404 for no such take
    (or one of a job another key made, ``keys.py``)."""
    ref = parse_id(path)
    if ref is None:
        raise AceError(403, "Access denied: path is not an audio file this server returned.")
    try:
        await svc.visible(ref.job_id, caller)
        f = await svc.track_file(ref.job_id, ref.index, "wav" if ref.fmt == "flac" else ref.fmt)
    except SongserveError:
        raise AceError(404, "Audio file not found") from None
    if ref.fmt != "flac":
        return f.path, MEDIA[ref.fmt]
    try:
        return await asyncio.to_thread(flac_beside, f.path), MEDIA["flac"]
    except (OSError, RuntimeError) as exc:  # soundfile raises LibsndfileError, a RuntimeError
        raise AceError(500, f"The FLAC file could not be written ({exc}).") from None


def flac_beside(wav: Path) -> Path:
    """``track_<i>.flac`` next to ``track_<i>.wav``, encoded once (again if the WAV is newer)."""
    out = wav.with_suffix(".flac")
    if out.is_file() and out.stat().st_mtime >= wav.stat().st_mtime:
        return out
    tmp = out.with_name(f".{out.name}.{secrets.token_hex(4)}.tmp")
    try:
        with sf.SoundFile(wav) as src:
            subtype = src.subtype if src.subtype in ("PCM_16", "PCM_24", "PCM_S8") else "PCM_24"
            with sf.SoundFile(
                tmp, "w", samplerate=src.samplerate, channels=src.channels, format="FLAC", subtype=subtype
            ) as dst:
                for block in src.blocks(blocksize=BLOCK_FRAMES, dtype="int32"):
                    dst.write(block)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out
