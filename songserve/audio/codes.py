"""A take's code grid as a file: what a finished take keeps so it can be continued later.

Why a file of our own: the grid (64 levels × frames, each code in [0, 1024)) is what a retake
continues from, and what the codec's decoder turns into audio; it is small (2 bytes a code: about
165 kB per minute of song) and must say which models made it and with which seed, since a
continuation is only exact with the same models. The layout, readable without numpy:

    8 bytes   b"SONGCODE"
    4 bytes   header length H, unsigned little-endian
    H bytes   header, UTF-8 JSON: {"format": 1, "levels", "frames", "dtype": "int16",
              "layout": "levels-major", "sample_rate", "frame_rate", "hop", "models": {...},
              "seed", and where known "job_id", "track_index", "task_id", "continued"}
    2·L·F     the codes, int16 little-endian, level-major (level 0 of every frame, then level 1, …)

Both services read it (the worker writes it beside its WAV; the dispatcher serves it at
``GET /job/{id}/track/{i}/codes`` and cuts the kept frames of a retake from it), so it lives beside
the wire models rather than in the pipeline.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"SONGCODE"
FORMAT = 1
SUFFIX = ".codes"
MAX_HEADER = 1 << 16  # bytes: the header is a few hundred
_LEN = struct.Struct("<I")
MAX_HEAD = len(MAGIC) + _LEN.size + MAX_HEADER  # bytes: enough of a file's start to read its header


class CodesFileError(ValueError):
    """Not a codes file, or a damaged one (one sentence naming what is wrong)."""


@dataclass(frozen=True)
class CodeGrid:
    """codes (levels, frames) int16, and the header that says what made them."""

    codes: np.ndarray
    header: dict[str, Any]

    @property
    def levels(self) -> int:
        return int(self.codes.shape[0])

    @property
    def frames(self) -> int:
        return int(self.codes.shape[1])

    def seconds(self) -> float:
        return self.frames / float(self.header["frame_rate"])

    def cut(self, frames: int) -> CodeGrid:
        """The first ``frames`` frames (every level), with the same header but its length."""
        kept = np.ascontiguousarray(self.codes[:, :frames])
        return CodeGrid(kept, {**self.header, "frames": int(kept.shape[1])})

    def opened(self, frames: int) -> CodeGrid:
        """This grid after ``frames`` placeholder frames (code 0, every level): the room a new opening is
        written into (an extension at the start); the header says its new length."""
        room = np.zeros((self.levels, frames), dtype=self.codes.dtype)
        grid = np.ascontiguousarray(np.concatenate([room, self.codes], axis=1))
        return CodeGrid(grid, {**self.header, "frames": int(grid.shape[1])})

    def raw(self) -> bytes:
        """The codes as the wire carries them (``PrefixCodes``): int16 little-endian, level-major."""
        return self.codes.astype("<i2", copy=False).tobytes()


def encode(codes: np.ndarray, header: dict[str, Any]) -> bytes:
    """codes (levels, frames) of integers in [0, 1024) → the file's bytes."""
    if codes.ndim != 2:
        raise ValueError(f"codes must be (levels, frames), got shape {codes.shape}")
    grid = np.ascontiguousarray(codes, dtype="<i2")
    head = {
        **header,
        "format": FORMAT,
        "levels": int(grid.shape[0]),
        "frames": int(grid.shape[1]),
        "dtype": "int16",
        "layout": "levels-major",
    }
    text = json.dumps(head, ensure_ascii=False, sort_keys=True).encode()
    return MAGIC + _LEN.pack(len(text)) + text + grid.tobytes()


def read_header(head: bytes, size: int) -> tuple[dict[str, Any], int]:
    """A codes file's header and where its codes start, from its first bytes (``head``, at least the
    whole header) and its length in bytes; ``CodesFileError`` when they do not fit each other."""
    if head[: len(MAGIC)] != MAGIC:
        raise CodesFileError("not a songserve codes file (its first bytes are not SONGCODE)")
    start = len(MAGIC) + _LEN.size
    if len(head) < start:
        raise CodesFileError("the codes file ends inside its header")
    (n,) = _LEN.unpack_from(head, len(MAGIC))
    if n > MAX_HEADER or len(head) < start + n:
        raise CodesFileError("the codes file's header length does not fit the file")
    try:
        header = json.loads(head[start : start + n])
        levels, frames = int(header["levels"]), int(header["frames"])
    except (ValueError, KeyError, TypeError):
        raise CodesFileError("the codes file's header is not the expected JSON") from None
    if header.get("format") != FORMAT or header.get("dtype") != "int16":
        raise CodesFileError(f"unknown codes file format {header.get('format')!r} / {header.get('dtype')!r}")
    body = size - start - n
    if levels < 1 or frames < 0 or body != 2 * levels * frames:
        raise CodesFileError(f"the codes file holds {body} bytes of codes for {levels} × {frames}")
    return header, start + n


def decode(data: bytes) -> CodeGrid:
    """The file's bytes → its grid, or ``CodesFileError`` saying what does not fit."""
    header, start = read_header(data, len(data))
    levels, frames = int(header["levels"]), int(header["frames"])
    codes = np.frombuffer(data[start:], dtype="<i2").reshape(levels, frames).astype(np.int16)
    return CodeGrid(codes, header)


def read(path: Path) -> CodeGrid:
    return decode(path.read_bytes())
