"""The decoded audio of this worker's latest takes, kept so that an edit of one decodes only what it changes.

Why: an edit (a repaint of a part, a new opening) changes the codes of a few seconds of a song, and
outside ``samples_touched`` (``codec.py``) its audio is the original's sample for sample; yet the
decoder would decode the whole grid again, the largest part of a 20 s repaint's cost in a 3-minute
song. With the original's decoded audio at hand the edit decodes only the chunks that hold changed
samples and takes every other sample from the original:

- a take's audio is kept under its origin label (``<job_id>/<track_index>``, what a dispatcher sends
  as ``PrefixCodes.origin`` when it edits that take) with the codes it was decoded from and the
  decoder's chunking, in host memory, in an LRU bounded by bytes (``EDIT_AUDIO_MB``; 0 keeps none) and
  by ``MAX_TAKES`` (every ``/health`` lists the origins held: short takes would make that list long);
- an edit uses it only when the original was decoded with the same chunking and every frame the
  edit keeps has, in the kept grid, the same codes at its place (shifted by a new opening's frames):
  anything else (another chunking, another grid under the same label) decodes the whole grid;
- the chunks decoded are ``decode``'s own (``AudioDecoder.decode_chunk``), so the samples an edit
  changes are computed exactly as a whole decode computes them, and every other sample is the
  original's (a whole decode gives the same for a repaint on the CPU; for a new opening, whose frames
  move the chunks against the original's, it differs by a least significant bit here and there:
  docs/model.md).

``/health`` → ``kept_audio`` lists the origins held (a dispatcher sends an edit of one of them to this
worker, ``api/dispatch/placement.py``). Kept and read on the model thread; ``describe`` runs on the
event loop, hence the lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from songserve.pipeline.stages.codec import AudioDecoder, decode_chunks

MAX_TAKES = 64  # takes held at most, whatever their bytes


@dataclass(frozen=True, eq=False)  # compared by identity: equality of the fields would compare arrays
class Decoded:
    """One take's decode: the codes it came from and its samples."""

    origin: str
    codes: np.ndarray  # (levels, frames) the decoder read
    audio: np.ndarray  # (samples, channels) float32, what the take's WAV was written from
    chunking: tuple[int, int]  # DECODE_CHUNK_FRAMES, DECODE_CONTEXT_FRAMES it was decoded with

    @property
    def nbytes(self) -> int:
        return int(self.codes.nbytes + self.audio.nbytes)


class KeptAudio:
    """An LRU of ``Decoded`` by origin, at most ``capacity`` bytes and ``MAX_TAKES`` takes."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(0, capacity)
        self._slots: OrderedDict[str, Decoded] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0  # edits that decoded only their changed chunks
        self.misses = 0  # edits of an origin held here that decoded the whole grid

    def keep(self, take: Decoded) -> None:
        """Hold ``take`` (replacing an older one of the same origin), dropping the least recently used
        takes until it fits; one larger than the whole bound is not kept."""
        if not take.origin or take.nbytes > self.capacity:
            return
        with self._lock:
            self._slots.pop(take.origin, None)
            while self._slots and (
                len(self._slots) >= MAX_TAKES
                or sum(t.nbytes for t in self._slots.values()) + take.nbytes > self.capacity
            ):
                self._slots.popitem(last=False)
            self._slots[take.origin] = take

    def find(self, origin: str) -> Decoded | None:
        """The take of ``origin``, now the most recently used; None when none is held."""
        with self._lock:
            take = self._slots.get(origin)
            if take is not None:
                self._slots.move_to_end(origin)
            return take

    def counted(self, hit: bool) -> None:
        with self._lock:
            if hit:
                self.hits += 1
            else:
                self.misses += 1

    def describe(self) -> dict[str, Any]:
        """``/health``'s ``kept_audio``: the origins held (oldest first), their bytes, the bound, the edits served."""
        with self._lock:
            slots = list(self._slots.values())
            return {
                "origins": [t.origin for t in slots],
                "bytes": sum(t.nbytes for t in slots),
                "capacity_bytes": self.capacity,
                "hits": self.hits,
                "misses": self.misses,
            }


@dataclass(frozen=True)
class EditDecode:
    """An edit's audio from its original's and the chunks it decoded."""

    audio: np.ndarray  # (samples, channels) float32
    chunks: int  # decoded
    of: int  # in the whole grid


def usable(
    original: Decoded,
    codes: np.ndarray,
    new_spans: list[tuple[int, int]],
    shift: int,
    chunking: tuple[int, int],
    hop: int,
) -> bool:
    """``original`` serves an edit whose grid is ``codes``: decoded with the same chunking, as long as the
    grid less ``shift`` frames of a new opening, and every frame of ``codes`` outside ``new_spans`` (frames
    ``[start, join)``, written anew) holds the codes the original holds ``shift`` frames earlier, on every
    level the decoder reads."""
    levels, frames = codes.shape
    if original.chunking != chunking or original.codes.shape != (levels, frames - shift):
        return False
    if original.audio.shape[0] != (frames - shift) * hop:
        return False
    kept = np.ones(frames, dtype=bool)
    kept[:shift] = False
    for start, stop in new_spans:
        kept[start:stop] = False
    at = np.flatnonzero(kept)
    return bool(np.array_equal(codes[:, at], original.codes[:, at - shift]))


def decode_edit(
    decoder: AudioDecoder,
    codes: torch.Tensor,  # (levels, frames) on the decoder's device, the levels it reads
    original: Decoded,
    touched: list[tuple[int, int]],  # samples [first, last) that may differ from the original (``samples_touched``)
    shift: int,  # frames of a new opening before the original's first
    chunking: tuple[int, int],
    on_chunk: Callable[[int, int], None] | None = None,
) -> EditDecode:
    """The edit's audio: the original's samples (after ``shift`` frames of room), and within ``touched`` the
    samples of ``decode``'s chunks that hold them, decoded here."""
    hop = decoder.cfg.hop
    frames = int(codes.shape[-1])
    audio = np.empty((frames * hop, original.audio.shape[1]), dtype=np.float32)
    audio[shift * hop :] = original.audio
    ranges = [(a, b) for a, b in touched if b > a]
    if shift:
        ranges.append((0, shift * hop))
    spans = decode_chunks(frames, *chunking)
    hit = [s for s in spans if any(s[0] * hop < last and s[1] * hop > first for first, last in ranges)]
    for k, span in enumerate(hit):
        wave = decoder.decode_chunk(codes.unsqueeze(0), span)[0].float().t().cpu().numpy()
        base = span[0] * hop
        for first, last in ranges:
            lo, hi = max(first, base), min(last, base + wave.shape[0])
            if lo < hi:
                audio[lo:hi] = wave[lo - base : hi - base]
        if on_chunk:
            on_chunk(k + 1, len(hit))
    return EditDecode(audio, len(hit), len(spans))
