"""Is a copied result file what its worker said it wrote? Checked before a track is completed.

Our workers say each file's size and SHA-256 (``WorkerGenerateResult.files``): the copy must match
both. The reference's workers say nothing about their files, so for every worker a WAV is also read
as a WAV: its RIFF and data chunk sizes must agree with the file's length, and its frames with the
``duration_sec`` of the answer. That catches a truncated file even when its header was rewritten to
match (self-consistent but short). A code grid (``.codes``, only our workers write one) is read the
same way: its header's levels × frames must fill the file exactly, since a retake continues from it.
A failed check is ``WorkerFault``: the worker's, not the track's.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from songserve.api.workers.outcomes import WorkerFault
from songserve.audio import codes
from songserve.schemas import ResultFile

DURATION_SLACK_SEC = 0.05  # about one codec frame (2,048 samples at 44.1 kHz): rounding, never a cut song
DURATION_SLACK_SHARE = 0.001
HEADER_BYTES = 1 << 16  # a WAV's chunks before its samples fit well within this


@dataclass(frozen=True)
class Copied:
    """What arrived: the temporary file, its length in bytes and its SHA-256 (hex)."""

    path: Path
    size: int
    sha256: str


@dataclass(frozen=True)
class WavFacts:
    channels: int
    sample_rate: int  # Hz
    frames: int  # samples per channel

    @property
    def duration_sec(self) -> float:
        return self.frames / self.sample_rate


def check_copy(name: str, kind: str, got: Copied, said: ResultFile | None, duration_sec: float) -> None:
    """Raise ``WorkerFault`` naming what is wrong with the copy of ``name`` (a ``kind`` of wav, mp3, json, codes)."""
    if got.size == 0:
        raise WorkerFault(f"{name} arrived empty.")
    if said is not None:
        if got.size != said.bytes:
            raise WorkerFault(f"{name} arrived with {got.size} bytes; the worker said it wrote {said.bytes}.")
        if got.sha256 != said.sha256:
            raise WorkerFault(f"{name} arrived with SHA-256 {got.sha256[:12]}…; the worker said {said.sha256[:12]}….")
    if kind == "wav":
        wav = read_wav_header(got.path, got.size, name)
        slack = max(DURATION_SLACK_SEC, DURATION_SLACK_SHARE * duration_sec)
        if abs(wav.duration_sec - duration_sec) > slack:
            raise WorkerFault(
                f"{name} holds {wav.duration_sec:.3f}s of audio ({wav.frames} frames at {wav.sample_rate} Hz); "
                f"the worker said {duration_sec:.3f}s."
            )
    if kind == "codes":
        with open(got.path, "rb") as f:
            head = f.read(codes.MAX_HEAD)
        try:
            codes.read_header(head, got.size)
        except codes.CodesFileError as exc:
            raise WorkerFault(f"{name}: {exc}.") from None


def read_wav_header(path: Path, size: int, name: str) -> WavFacts:
    """The format and frame count of a RIFF/WAVE file whose sizes agree with its ``size`` bytes."""
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    if len(head) < 12 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        raise WorkerFault(f"{name} is not a RIFF/WAVE file.")
    riff_size = struct.unpack_from("<I", head, 4)[0]
    if riff_size + 8 != size:
        raise WorkerFault(f"{name}: its RIFF header says {riff_size + 8} bytes, the file has {size}.")
    fmt: tuple[int, int, int] | None = None  # (channels, sample rate, bytes per frame)
    pos = 12
    while pos + 8 <= len(head):
        chunk, length = head[pos : pos + 4], struct.unpack_from("<I", head, pos + 4)[0]
        body = pos + 8
        if chunk == b"fmt " and length >= 16 and body + 16 <= len(head):
            _, channels, rate, _, align = struct.unpack_from("<HHIIH", head, body)
            fmt = (channels, rate, align)
        elif chunk == b"data":
            if fmt is None or not all(fmt):
                raise WorkerFault(f"{name}: no usable fmt chunk before its samples.")
            if body + length > size:
                raise WorkerFault(f"{name}: its data chunk says {length} bytes, only {size - body} follow.")
            channels, rate, align = fmt
            if length % align:
                raise WorkerFault(f"{name}: {length} bytes of samples is not a whole number of frames.")
            return WavFacts(channels, rate, length // align)
        pos = body + length + (length & 1)  # chunks are padded to an even length
    raise WorkerFault(f"{name}: no data chunk in its first {HEADER_BYTES} bytes.")
