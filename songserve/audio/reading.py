"""A person's own audio file as the codec takes it: 44.1 kHz stereo float samples in [-1, 1].

Both services read uploads with this one module, so they agree on every sample: the dispatcher
to refuse a file before storing anything (and to say how long it is: ``check_audio``, which keeps
no samples), the worker to encode it (``read_audio``).

- Formats: whatever libsndfile reads through ``soundfile`` (WAV, FLAC, OGG/Vorbis and Opus, MP3,
  AIFF, …), from memory or from an open file (a spooled request body): a client's file name never
  becomes a path.
- Any sample rate, resampled to 44.1 kHz with libsoxr (``soxr``, its "HQ" quality, as a stream);
  audio already at 44.1 kHz is not touched.
- One channel is copied to both; more than two are mixed down: the first two are left and right,
  every other one goes to both at −3 dB, and the sum is scaled so full scale everywhere stays in
  range (``downmix``).
- Samples past full scale (a float file, or a resampler's overshoot on clipped audio) are clipped
  to [-1, 1]; NaN and infinities become silence.
- Refused, with a sentence (``AudioError``): an empty file, a file libsndfile cannot read as audio,
  one cut short (a WAV whose data chunk promises more bytes than the file holds, any file that
  decodes to fewer frames than its header says, or a decoder that loses sync), one with less
  than a frame of audio, one longer than ``max_sec`` (checked from the header before decoding,
  then exactly), and one whose header promises more samples to decode than ``max_sec`` of
  ``MAX_SOURCE_RATE`` Hz in ``MAX_SOURCE_CHANNELS`` channels. Silence is audio.

Memory: a file is decoded, mixed down and resampled block by block (``BLOCK_SAMPLES`` source
samples at a time) straight into its 44.1 kHz stereo array, so a small file that decodes to
gigabytes (a minute of silence at 384 kHz in 8 channels is a 200 KB FLAC and 737 MB of float samples)
costs what its 44.1 kHz stereo samples do, and ``check_audio`` a constant. The header's promise
bounds the decoding's time: a file promising more than the source cap is refused before a block
is read.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO

import numpy as np

SAMPLE_RATE = 44100  # what the codec takes (pipeline/numbers.py; not imported: the dispatcher needs no pipeline)
HOP = 2048  # samples per frame of the codec
MIN_SAMPLES = HOP  # one frame: anything shorter encodes to nothing
# The most a file may ask to be decoded, per second of the length cap: 192 kHz in 8 channels (7.1
# studio masters). A longer-than-usual rate or more channels pass while the whole stays within it.
MAX_SOURCE_RATE = 192_000
MAX_SOURCE_CHANNELS = 8
BLOCK_SAMPLES = 1 << 18  # source samples (frames × channels) decoded at a time: 1 MiB of float32
EXTENSIONS = {
    "WAV": "wav",
    "WAVEX": "wav",
    "RF64": "wav",
    "FLAC": "flac",
    "OGG": "ogg",
    "MP3": "mp3",
    "AIFF": "aiff",
    "CAF": "caf",
    "W64": "w64",
}


class AudioError(ValueError):
    """The file cannot be used as audio; ``str()`` completes "the file …" (no trailing period)."""


@dataclass(frozen=True)
class AudioFacts:
    """What the file was, and what it became."""

    format: str  # libsndfile's major format: WAV, FLAC, OGG, MP3, …
    subtype: str  # PCM_16, VORBIS, MPEG_LAYER_III, …
    sample_rate: int  # the file's own
    channels: int  # the file's own
    source_frames: int  # frames decoded at the file's rate
    samples: int  # at 44.1 kHz, per channel, after resampling

    @property
    def duration_sec(self) -> float:
        return self.samples / SAMPLE_RATE

    @property
    def extension(self) -> str:
        return EXTENSIONS.get(self.format, "audio")

    def describe(self) -> dict[str, object]:
        return {
            "format": self.format,
            "subtype": self.subtype,
            "sample_rate": self.sample_rate,
            "channels": self.channels,
            "frames": self.source_frames,
        }


Source = bytes | IO[bytes]  # the file's bytes, or an open binary file positioned anywhere (read from its start)


def read_audio(source: Source, max_sec: float | None = None) -> tuple[np.ndarray, AudioFacts]:
    """(samples (2, n) float32 at 44.1 kHz in [-1, 1], facts), or ``AudioError`` saying what is wrong."""
    out = _Samples()
    facts = _decode(source, max_sec, out)
    return out.result(), facts


def check_audio(source: Source, max_sec: float | None = None) -> AudioFacts:
    """``read_audio``'s facts and refusals, keeping no samples: memory stays one block whatever the file."""
    return _decode(source, max_sec, None)


class _Samples:
    """The 44.1 kHz stereo output, filled block by block: sized from the header's promise (plus the
    resampler's rounding), so the whole costs its own size; a file that holds more grows in steps."""

    def __init__(self) -> None:
        self.flat = np.empty(0, dtype=np.float32)
        self.cap = 0  # frames the array holds room for
        self.n = 0  # frames written
        self.extra: list[np.ndarray] = []  # blocks past the promise (a header that said too little)

    def reserve(self, frames: int) -> None:
        self.cap = max(frames, 0)
        self.flat = np.empty(2 * self.cap, dtype=np.float32)

    def add(self, block: np.ndarray) -> None:
        """``block``: (frames, 2) float32."""
        k = int(block.shape[0])
        room = min(k, self.cap - self.n) if not self.extra else 0
        if room > 0:
            view = self.flat.reshape(2, self.cap)
            view[:, self.n : self.n + room] = block[:room].T
            self.n += room
        if room < k:
            self.extra.append(np.ascontiguousarray(block[room:].T))

    def frames(self) -> int:
        return self.n + sum(int(b.shape[1]) for b in self.extra)

    def result(self) -> np.ndarray:
        """(2, frames) C-contiguous: the reserved array compacted in place when it was not filled."""
        if self.extra:
            return np.concatenate([self.flat.reshape(2, self.cap)[:, : self.n], *self.extra], axis=1)
        if self.n < self.cap:  # right channel moved down behind the left, a slice at a time (numpy handles overlap)
            right = self.flat[self.cap : self.cap + self.n]
            step = 1 << 16
            for i in range(0, self.n, step):
                self.flat[self.n + i : self.n + min(i + step, self.n)] = right[i : i + step]
        return self.flat[: 2 * self.n].reshape(2, self.n)


def _decode(source: Source, max_sec: float | None, out: _Samples | None) -> AudioFacts:
    import soundfile as sf

    f_in: IO[bytes] = io.BytesIO(source) if isinstance(source, bytes) else source
    size = _size(f_in)
    if size == 0:
        raise AudioError("is empty")
    f_in.seek(0)
    try:
        f = sf.SoundFile(f_in)
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError):
        raise AudioError("is not audio that can be read (WAV, FLAC, OGG, MP3 and other libsndfile formats)") from None
    with f:
        rate, channels, declared = int(f.samplerate), int(f.channels), int(f.frames)
        if rate <= 0 or channels <= 0:
            raise AudioError("is not audio that can be read (its header gives no sample rate or channels)")
        _check_length(declared / rate, max_sec)
        _check_source(declared, rate, channels, max_sec)
        if f.format in ("WAV", "WAVEX"):
            _check_wav_data_chunk(f_in, size)
        if out is not None:
            out.reserve(_expected(declared, rate))
        got, made = _stream(f, rate, channels, out)
        fmt, subtype = str(f.format), str(f.subtype)
    if declared > 0 and got + max(4096, declared // 100) < declared:
        raise AudioError(f"is cut short: its header promises {declared} frames, it holds {got}")
    if got == 0:
        raise AudioError("is empty: it holds no audio frames")
    facts = AudioFacts(fmt, subtype, rate, channels, got, made)
    if facts.samples < MIN_SAMPLES:
        raise AudioError(
            f"is too short: {facts.duration_sec * 1000:.0f} ms, less than one frame of the codec "
            f"({MIN_SAMPLES / SAMPLE_RATE * 1000:.0f} ms)"
        )
    _check_length(facts.duration_sec, max_sec)
    return facts


def _stream(f: object, rate: int, channels: int, out: _Samples | None) -> tuple[int, int]:
    """Decode ``f`` block by block into ``out`` (None: count only); (source frames, 44.1 kHz frames)."""
    import soundfile as sf

    resample: Callable[[np.ndarray, bool], np.ndarray] | None = None
    if rate != SAMPLE_RATE:
        import soxr

        stream = soxr.ResampleStream(rate, SAMPLE_RATE, 2, dtype="float32", quality="HQ")
        resample = stream.resample_chunk
    block = np.empty((max(256, BLOCK_SAMPLES // channels), channels), dtype=np.float32)
    got = made = 0
    while True:
        try:
            x = f.read(block.shape[0], dtype="float32", always_2d=True, out=block)  # type: ignore[attr-defined]
        except (sf.LibsndfileError, RuntimeError) as exc:
            raise AudioError(f"is damaged or cut short ({str(exc).rsplit(':', 1)[-1].strip()})") from None
        k = int(x.shape[0])
        got += k
        last = k < block.shape[0]
        if not np.isfinite(x).all():  # a float file's NaN and infinities: silence (a whole pass only then)
            x = np.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
        y = np.clip(downmix(x), -1.0, 1.0, dtype=np.float32)
        if resample is not None:
            y = np.clip(resample(y, last), -1.0, 1.0, dtype=np.float32)
        made += int(y.shape[0])
        if out is not None and y.shape[0]:
            out.add(y)
        if last:
            return got, made


def _expected(declared: int, rate: int) -> int:
    """The 44.1 kHz frames a file of ``declared`` frames resamples to (libsoxr rounds; one frame of slack)."""
    return -(-declared * SAMPLE_RATE // rate) + 1 if declared > 0 else 0


def _check_length(seconds: float, max_sec: float | None) -> None:
    if max_sec is not None and seconds > max_sec:
        raise AudioError(
            f"is {seconds:.1f} s long, longer than the longest song the model can continue ({max_sec:.1f} s)"
        )


def _check_source(frames: int, rate: int, channels: int, max_sec: float | None) -> None:
    """What the header promises to decode (length × rate × channels) within ``max_sec`` of 192 kHz in 8 channels."""
    if max_sec is None:
        return
    cap = int(max_sec * MAX_SOURCE_RATE * MAX_SOURCE_CHANNELS)
    if frames * channels > cap:
        raise AudioError(
            f"would decode to {frames * channels:,} samples ({frames / rate:.1f} s at {rate} Hz in {channels} "
            f"channels), more than the {cap:,} an upload of at most {max_sec:.1f} s may decode to "
            f"({MAX_SOURCE_RATE} Hz in {MAX_SOURCE_CHANNELS} channels)"
        )


def downmix(x: np.ndarray) -> np.ndarray:
    """(frames, channels) → (frames, 2): mono copied to both sides; beyond two channels, the first two
    are left and right and each other one goes to both at −3 dB, the sum scaled by 1 / (1 + 0.7071·(n − 2))."""
    n = x.shape[1]
    if n == 2:
        return x
    if n == 1:
        return np.repeat(x, 2, axis=1)
    scale = 1 + np.sqrt(0.5) * (n - 2)
    weights = np.full((n, 2), np.sqrt(0.5) / scale, dtype=np.float32)  # one matrix product: one pass over the block
    weights[:2] = np.eye(2) / scale
    mixed: np.ndarray = x @ weights
    return mixed


def _size(f: IO[bytes]) -> int:
    f.seek(0, io.SEEK_END)
    return f.tell()


def _check_wav_data_chunk(f: IO[bytes], size: int) -> None:
    """A RIFF WAV whose ``data`` chunk says more bytes than follow it is cut short (libsndfile reads what
    is there without a word). Sizes 0 and 0xFFFFFFFF mean "unknown" (streamed files) and are not checked.
    Reads chunk headers only; the file's position is left where libsndfile had it."""
    at = f.tell()
    try:
        f.seek(0)
        head = f.read(12)
        if head[:4] != b"RIFF" or head[8:12] != b"WAVE":
            return
        pos = 12
        while pos + 8 <= size:
            f.seek(pos)
            chunk = f.read(8)
            cid, length = chunk[:4], struct.unpack_from("<I", chunk, 4)[0]
            if cid == b"data":
                have = size - pos - 8
                if length not in (0, 0xFFFFFFFF) and have < length:
                    raise AudioError(f"is cut short: its data chunk promises {length} bytes, {have} follow")
                return
            pos += 8 + length + (length & 1)
    finally:
        f.seek(at)
