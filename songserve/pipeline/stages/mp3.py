"""A take's MP3 as the reference makes it: LAME at constant bitrate, an ID3v2.3 tag, an Info frame.

The reference runs ``ffmpeg -i take.wav -b:a 320k take.mp3``: libmp3lame at CBR 320 kbit/s from the
WAV's 16-bit samples, LAME's algorithm quality left at its default (3). ``lameenc`` runs the same LAME
about 3.5× cheaper than libsndfile's MP3 writer, but it writes bare frames: no tags and no Info frame.
This module writes both itself:

- the **ID3v2.3 tag** before the frames: ``TIT2`` (title), ``COMM`` (language ``eng``, empty
  description: the lyrics) and ``TSSE`` (software); ISO-8859-1 when the text fits it, else UTF-16
  with a byte-order mark; an empty value is left out.
- the **Info frame** (Xing header of a CBR stream, with LAME's extension) as the first frame: the
  frame and byte counts, and the encoder delay and padding, so a decoder (mpg123, ffmpeg) trims
  what LAME adds and the MP3 decodes to exactly the WAV's number of samples.

The builders are pure (bytes in, bytes out); ``encode`` is the only one that runs LAME.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator

import lameenc
import numpy as np

SAMPLES_PER_FRAME = 1152  # an MPEG-1 Layer III frame
ENCODER_DELAY = 576  # the samples LAME puts before the audio (the decoder's own 529 it trims itself)
MAX_KBPS = 320
DEFAULT_QUALITY = 3  # LAME's own default (lame.c LAME_DEFAULT_QUALITY), what ffmpeg leaves it at
MPEG1_KBPS = (32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320)  # bitrate index 1..14
MPEG1_RATES = (44100, 48000, 32000)  # sample rate index 0..2
SOFTWARE = "songserve"
ENCODER_VERSION = b"LAME4.0 \x00"  # the tag's 9 bytes: lameenc 1.9 bundles LAME 4.0 (its frames say so)


def cbr_kbps(compression_level: float) -> int:
    """Compression level (0 = best … 1) → bitrate: the largest MPEG-1 Layer III bitrate ≤ 320 − level × 288.

    Level 0 gives 320 kbit/s (the reference's), level 1 gives 32 kbit/s, the smallest MPEG-1 has."""
    ceiling = MAX_KBPS - compression_level * (MAX_KBPS - MPEG1_KBPS[0])
    return max([k for k in MPEG1_KBPS if k <= ceiling + 1e-9], default=MPEG1_KBPS[0])


# --- ID3v2.3 ---------------------------------------------------------------------------------------


def _text(value: str) -> bytes:
    """ID3v2.3 encoding byte + text: ISO-8859-1 when the text fits it, else UTF-16 with a BOM."""
    try:
        return b"\x00" + value.encode("latin-1")
    except UnicodeEncodeError:
        return b"\x01" + value.encode("utf-16")  # Python writes the BOM (little-endian here)


def _frame(frame_id: str, body: bytes) -> bytes:
    return frame_id.encode("ascii") + struct.pack(">IH", len(body), 0) + body


def _syncsafe(n: int) -> bytes:
    return bytes((n >> shift) & 0x7F for shift in (21, 14, 7, 0))


def id3v2_tag(title: str, comment: str, software: str = SOFTWARE) -> bytes:
    """An ID3v2.3 tag with title, comment (the lyrics) and software; empty values are left out."""
    frames = b""
    if title:
        frames += _frame("TIT2", _text(title))
    if comment:
        coded = _text(comment)  # the description (empty) is coded like the text and ends in a NUL
        nul = b"\xff\xfe\x00\x00" if coded[0] == 1 else b"\x00"
        frames += _frame("COMM", coded[:1] + b"eng" + nul + coded[1:])
    if software:
        frames += _frame("TSSE", _text(software))
    if not frames:
        return b""
    return b"ID3\x03\x00\x00" + _syncsafe(len(frames)) + frames


# --- MPEG frames -------------------------------------------------------------------------------------


def frame_length(header: bytes) -> int:
    """Bytes of the MPEG-1 Layer III frame whose 4-byte header is given."""
    b1, b2 = header[1], header[2]
    if header[0] != 0xFF or b1 & 0xFE != 0xFA:
        raise ValueError(f"not an MPEG-1 Layer III frame header: {header[:4].hex()}")
    kbps, rate = MPEG1_KBPS[(b2 >> 4) - 1], MPEG1_RATES[(b2 >> 2) & 3]
    return 144_000 * kbps // rate + ((b2 >> 1) & 1)


def frames(stream: bytes) -> Iterator[tuple[int, int]]:
    """(offset, length) of each frame of a bare Layer III stream (no tags)."""
    offset = 0
    while offset < len(stream):
        length = frame_length(stream[offset : offset + 4])
        yield offset, length
        offset += length


_CRC16 = [0] * 256
for _i in range(256):
    _c = _i
    for _ in range(8):
        _c = (_c >> 1) ^ 0xA001 if _c & 1 else _c >> 1
    _CRC16[_i] = _c


def crc16(data: bytes, crc: int = 0) -> int:
    """CRC-16 as LAME's tag computes it (polynomial 0x8005, reflected, starting at 0)."""
    for byte in data:
        crc = (crc >> 8) ^ _CRC16[(crc ^ byte) & 0xFF]
    return crc


def info_frame(stream: bytes, samples: int, lowpass_hz: int = 0) -> bytes:
    """The Info frame that goes before ``stream`` (LAME's bare CBR frames of ``samples`` samples).

    A silent frame with the first frame's header (no padding bit) and, after its side information,
    "Info", the frame count, the byte count (Info frame included), a linear seek table, the
    quality, then LAME's 36-byte extension: encoder delay and padding (what a gapless decoder trims),
    the music length and CRC, and the CRC of the frame up to there."""
    spans = list(frames(stream))
    first = stream[:4]
    header = bytes((first[0], first[1], first[2] & 0xFD, first[3]))
    size = frame_length(header)
    mono = header[3] >> 6 == 3
    offset = 4 + (17 if mono else 32)  # after the side information
    if size < offset + 156:
        header = bytes((header[0], header[1], (14 << 4) | (header[2] & 0x0D), header[3]))  # a 320 kbit/s frame
        size = frame_length(header)
    kbps = MPEG1_KBPS[(stream[2] >> 4) - 1]
    padding = len(spans) * SAMPLES_PER_FRAME - ENCODER_DELAY - samples
    if not 0 <= padding < 4096:
        raise ValueError(f"{len(spans)} frames cannot hold {samples} samples after the encoder delay")
    total = size + len(stream)
    xing = b"Info" + struct.pack(">III", 0x0F, len(spans), total)
    xing += bytes(i * 256 // 100 for i in range(100)) + struct.pack(">I", 0)
    lame = ENCODER_VERSION
    lame += bytes((0x01, min(255, lowpass_hz // 100)))  # tag revision 0, CBR; lowpass in 100 Hz
    lame += struct.pack(">fHH", 0.0, 0, 0)  # peak, radio and audiophile replay gain: not measured
    lame += bytes((0x00, min(255, kbps)))  # encoding flags and ATH type; the bitrate
    lame += bytes((ENCODER_DELAY >> 4, ((ENCODER_DELAY & 0xF) << 4) | (padding >> 8), padding & 0xFF))
    lame += bytes((0x00, 0x00)) + struct.pack(">H", 0)  # misc, MP3 gain, preset and surround
    lame += struct.pack(">IH", total, crc16(stream))  # music length (from this frame) and its CRC
    frame = bytearray(size)
    frame[:4] = header
    frame[offset : offset + len(xing) + len(lame)] = xing + lame
    tag_end = offset + len(xing) + len(lame)
    frame[tag_end : tag_end + 2] = struct.pack(">H", crc16(bytes(frame[:tag_end])))
    return bytes(frame)


# --- LAME --------------------------------------------------------------------------------------------


def encode(
    pcm: np.ndarray,
    sample_rate: int,
    kbps: int,
    quality: int,
    block: int,
    on_block: Callable[[float], None],
) -> bytes:
    """int16 samples (samples, channels) → LAME's bare CBR frames, fed ``block`` samples at a time.

    ``on_block(share)`` after each block (the share of the samples encoded). LAME buffers across
    calls, so the frames are the same whatever the block."""
    pcm = pcm if pcm.ndim == 2 else pcm[:, None]
    enc = lameenc.Encoder()
    enc.set_bit_rate(kbps)
    enc.set_in_sample_rate(sample_rate)
    enc.set_out_sample_rate(sample_rate)
    enc.set_channels(pcm.shape[1])
    enc.set_quality(quality)
    parts: list[bytes] = []
    total = max(1, pcm.shape[0])
    for start in range(0, max(1, pcm.shape[0]), block):  # LAME flushes only what it has begun: one call at least
        parts.append(bytes(enc.encode(np.ascontiguousarray(pcm[start : start + block]).tobytes())))
        on_block(min(total, start + block) / total)
    parts.append(bytes(enc.flush()))
    return b"".join(parts)


def mp3_file(
    pcm: np.ndarray,
    sample_rate: int,
    kbps: int,
    quality: int,
    title: str,
    comment: str,
    block: int,
    on_block: Callable[[float], None],
) -> bytes:
    """The whole file: ID3v2.3 tag, Info frame, LAME's frames."""
    stream = encode(pcm, sample_rate, kbps, quality, block, on_block)
    return id3v2_tag(title, comment) + info_frame(stream, pcm.shape[0]) + stream
