"""Export: WAV, MP3 and JSON for one track, each written atomically into the output folder.

Names follow the reference: ``YYYYmmdd_HHMMSS_<8 hex>.{wav,mp3,json}``. MP3 goes through
``soundfile``'s bundled libsndfile (no system package), constant bitrate, highest quality by
default. Each file is written under a temporary name in the same folder, then renamed.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf


@dataclass(frozen=True)
class Mp3Options:
    bitrate_mode: str = "CONSTANT"
    compression_level: float = 0.0  # 0 = highest quality


def new_basename(now: float | None = None) -> str:
    stamp = time.strftime("%Y%m%d_%H%M%S", time.localtime(now))
    return f"{stamp}_{secrets.token_hex(4)}"


def _atomic(path: Path, write: Callable[[Path], object]) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(3)}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_track(
    out_dir: Path, audio: np.ndarray, sample_rate: int, metadata: dict, mp3: Mp3Options
) -> tuple[str, str, str, dict]:
    """audio (samples, channels) float32 in [-1, 1] → (wav, mp3, json) names and the metadata written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    base = new_basename()
    wav, mp3_name, meta = f"{base}.wav", f"{base}.mp3", f"{base}.json"
    audio = np.clip(audio, -1.0, 1.0)
    t0 = time.perf_counter()
    _atomic(out_dir / wav, lambda p: sf.write(p, audio, sample_rate, format="WAV", subtype="PCM_16"))
    _atomic(
        out_dir / mp3_name,
        lambda p: sf.write(
            p,
            audio,
            sample_rate,
            format="MP3",
            subtype="MPEG_LAYER_III",
            bitrate_mode=mp3.bitrate_mode,
            compression_level=mp3.compression_level,
        ),
    )
    timings = {**metadata.get("timings", {}), "export_sec": time.perf_counter() - t0}
    metadata = {**metadata, "timings": timings, "files": {"wav": wav, "mp3": mp3_name, "json": meta}}
    _atomic(out_dir / meta, lambda p: p.write_text(json.dumps(metadata, indent=2, ensure_ascii=False)))
    return wav, mp3_name, meta, metadata
