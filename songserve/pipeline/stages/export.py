"""Export: WAV, MP3, the code grid and JSON for one track, each written atomically into the output folder.

Names follow the reference: ``YYYYmmdd_HHMMSS_<8 hex>.{wav,mp3,json}``, plus ``.codes`` (the take's
64 × frames code grid, ``songserve/audio/codes.py``: what a later retake continues from). Each file is
written under a temporary name in the same folder, then renamed.

The MP3 at constant bitrate (``MP3_BITRATE_MODE=CONSTANT``, the default) is the reference's: LAME
through ``lameenc`` fed the 16-bit samples the WAV holds, read back from it, the ID3 tag and the
Info frame written around LAME's frames by ``mp3.py``. ``VARIABLE`` and ``AVERAGE`` go through ``soundfile``'s
bundled libsndfile (no system package), about 3.5× the CPU.

A failed export leaves nothing behind (neither its temporary file nor the files of the track it
already wrote) and raises ``ExportError``, an ``OSError`` whose errno says what happened:
``ENOSPC`` when the disk is full. libsndfile reports a full disk as a bare ``LibsndfileError``
with no errno, so the free space is measured after a failure to tell the two apart.

The MP3 encoder is the export's slow part (about 1 s of one core per minute of stereo audio with
LAME at quality 3, 3.4 s through libsndfile), so it is fed in blocks of ``MP3_BLOCK_SEC`` and reports after each one
(``on_progress``): progress moves through the export instead of standing still at its end. The
encoder buffers across writes, so the file is byte for byte the one a single write makes.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf

from songserve.audio import codes as codes_file
from songserve.pipeline.stages import mp3 as mp3_file

MP3_BLOCK_SEC = 10  # seconds of audio per MP3 write (a progress report after each)
WAV_SHARE = 0.1  # of the export: writing 16-bit PCM is about ten times quicker than LAME encoding the MP3
Progress = Callable[[float, str], None]  # (share of the export done, 0..1; what it is writing)


@dataclass(frozen=True)
class Mp3Options:
    bitrate_mode: str = "CONSTANT"
    compression_level: float = 0.0  # 0 = highest quality (320 kbit/s at CONSTANT: mp3.cbr_kbps)
    quality: int = mp3_file.DEFAULT_QUALITY  # LAME's algorithm quality at CONSTANT (0 = best … 9)
    title: str = ""  # ID3 tags, as a render of the take carries them (api/results/render.py)
    lyrics: str = ""

    def tagged(self, style: str, track_index: int, lyrics: str) -> Mp3Options:
        """These options with the take's title (its style and take number, as a render's) and lyrics."""
        style = style.strip()
        title = f"{style[:80]} (take {track_index + 1})" if style else f"songserve take {track_index + 1}"
        return Mp3Options(self.bitrate_mode, self.compression_level, self.quality, title, lyrics)


def new_basename(now: float | None = None) -> str:
    stamp = time.strftime("%Y%m%d_%H%M%S", time.localtime(now))
    return f"{stamp}_{secrets.token_hex(4)}"


FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class ExportError(OSError):
    """One file of a track could not be written (``errno`` ENOSPC/EDQUOT: the disk is full)."""


def _export_error(path: Path, need_bytes: int, exc: Exception) -> ExportError:
    """Say what a write failure was, in terms of the disk: full, or another write error."""
    code = exc.errno if isinstance(exc, OSError) else None
    if code not in FULL_ERRNOS:
        try:
            free = shutil.disk_usage(path.parent).free
        except OSError:
            free = None
        if free is not None and free < need_bytes + (1 << 20):
            code = errno.ENOSPC
    if code in FULL_ERRNOS:
        return ExportError(code, f"No space left on device writing {path.name}", str(path.parent))
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else (str(exc) or type(exc).__name__)
    return ExportError(code or errno.EIO, f"Could not write {path.name}: {reason}", str(path.parent))


def _atomic(path: Path, write: Callable[[Path], object], need_bytes: int = 0) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(3)}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except Exception as exc:
        tmp.unlink(missing_ok=True)
        raise _export_error(path, need_bytes, exc) from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write_mp3(
    path: Path, audio: np.ndarray, wav: Path, sample_rate: int, mp3: Mp3Options, on_progress: Progress
) -> None:
    """The MP3 of ``audio`` (samples, channels), whose WAV is ``wav``, in blocks, reporting the share
    written after each.

    At constant bitrate LAME gets the WAV's own 16-bit samples, read back from it (as the reference's
    ffmpeg does); the variable and average bitrate modes stay libsndfile's writer, fed ``audio``."""
    block = sample_rate * MP3_BLOCK_SEC

    def report(share: float) -> None:
        on_progress(share, "writing MP3")

    if mp3.bitrate_mode == "CONSTANT":
        pcm, _ = sf.read(wav, dtype="int16", always_2d=True)
        kbps = mp3_file.cbr_kbps(mp3.compression_level)
        path.write_bytes(mp3_file.mp3_file(pcm, sample_rate, kbps, mp3.quality, mp3.title, mp3.lyrics, block, report))
        return
    channels = audio.shape[1] if audio.ndim > 1 else 1
    total = max(1, audio.shape[0])
    opts = {"bitrate_mode": mp3.bitrate_mode, "compression_level": mp3.compression_level}
    with sf.SoundFile(path, "w", sample_rate, channels, format="MP3", subtype="MPEG_LAYER_III", **opts) as f:
        if mp3.title:
            f.title = mp3.title
        if mp3.lyrics:
            f.comment = mp3.lyrics
        f.software = mp3_file.SOFTWARE
        for start in range(0, audio.shape[0], block):
            f.write(audio[start : start + block])
            report(min(total, start + block) / total)


def write_track(
    out_dir: Path,
    audio: np.ndarray,
    sample_rate: int,
    metadata: dict[str, Any],
    mp3: Mp3Options,
    on_progress: Progress | None = None,
    codes: tuple[np.ndarray, dict[str, Any]] | None = None,
) -> tuple[str, str, str, dict[str, Any]]:
    """audio (samples, channels) float32 in [-1, 1] → (wav, mp3, json) names and the metadata written.

    ``on_progress(share, what)``: the WAV is a small share (it is quick), the MP3 the rest.
    ``codes``: the take's grid (levels, frames) and its file header, written as ``<base>.codes``
    (``metadata["files"]["codes"]``) once the MP3 is done (a few hundred kB: no share of its own).
    """
    report: Progress = on_progress or (lambda share, what: None)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _export_error(out_dir / "x", 0, exc) from exc
    base = new_basename()
    wav, mp3_name, meta = f"{base}.wav", f"{base}.mp3", f"{base}.json"
    audio = np.clip(audio, -1.0, 1.0)
    wav_bytes = audio.shape[0] * (audio.shape[1] if audio.ndim > 1 else 1) * 2
    written: list[Path] = []
    t0 = time.perf_counter()
    try:
        report(0.0, "writing WAV")
        _atomic(out_dir / wav, lambda p: sf.write(p, audio, sample_rate, format="WAV", subtype="PCM_16"), wav_bytes)
        written.append(out_dir / wav)
        report(WAV_SHARE, "writing MP3")

        def mp3_report(share: float, what: str) -> None:
            report(WAV_SHARE + (1 - WAV_SHARE) * share, what)

        _atomic(
            out_dir / mp3_name,
            lambda p: _write_mp3(p, audio, out_dir / wav, sample_rate, mp3, mp3_report),
            wav_bytes // 4,
        )
        written.append(out_dir / mp3_name)
        files = {"wav": wav, "mp3": mp3_name, "json": meta}
        if codes is not None:
            blob = codes_file.encode(*codes)
            files["codes"] = f"{base}{codes_file.SUFFIX}"
            _atomic(out_dir / files["codes"], lambda p: p.write_bytes(blob), len(blob))
            written.append(out_dir / files["codes"])
        timings = {**metadata.get("timings", {}), "export_sec": time.perf_counter() - t0}
        metadata = {**metadata, "timings": timings, "files": files}
        text = json.dumps(metadata, indent=2, ensure_ascii=False)
        _atomic(out_dir / meta, lambda p: p.write_text(text, encoding="utf-8"), len(text.encode()))
    except BaseException:
        for path in written:  # a failed track leaves no files behind
            path.unlink(missing_ok=True)
        raise
    return wav, mp3_name, meta, metadata
