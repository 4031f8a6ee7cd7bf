"""A person's own audio file as the codec takes it: 44.1 kHz stereo float samples in [-1, 1].

Both services read uploads with this one module, so they agree on every sample: the dispatcher
to refuse a file before storing anything (and to say how long it is), the worker to encode it.

- Formats: whatever libsndfile reads through ``soundfile`` (WAV, FLAC, OGG/Vorbis and Opus, MP3,
  AIFF, …), from memory: a client's file name never becomes a path.
- Any sample rate, resampled to 44.1 kHz with libsoxr (``soxr``, its "HQ" quality); audio already
  at 44.1 kHz is not touched.
- One channel is copied to both; more than two are mixed down: the first two are left and right,
  every other one goes to both at −3 dB, and the sum is scaled so full scale everywhere stays in
  range (``downmix``).
- Samples past full scale (a float file, or a resampler's overshoot on clipped audio) are clipped
  to [-1, 1]; NaN and infinities become silence.
- Refused, with a sentence (``AudioError``): an empty file, a file libsndfile cannot read as audio,
  one cut short (a WAV whose data chunk promises more bytes than the file holds, any file that
  decodes to fewer frames than its header says, or a decoder that loses sync), one with less
  than a frame of audio, and one longer than ``max_sec`` (checked from the header before decoding,
  then exactly). Silence is audio.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass

import numpy as np

SAMPLE_RATE = 44100  # what the codec takes (pipeline/numbers.py; not imported: the dispatcher needs no pipeline)
HOP = 2048  # samples per frame of the codec
MIN_SAMPLES = HOP  # one frame: anything shorter encodes to nothing
EXTENSIONS = {"WAV": "wav", "WAVEX": "wav", "RF64": "wav", "FLAC": "flac", "OGG": "ogg", "MP3": "mp3",
              "AIFF": "aiff", "CAF": "caf", "W64": "w64"}  # fmt: skip


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
        return {"format": self.format, "subtype": self.subtype, "sample_rate": self.sample_rate,
                "channels": self.channels, "frames": self.source_frames}  # fmt: skip


def read_audio(data: bytes, max_sec: float | None = None) -> tuple[np.ndarray, AudioFacts]:
    """(samples (2, n) float32 at 44.1 kHz in [-1, 1], facts), or ``AudioError`` saying what is wrong."""
    import soundfile as sf

    if not data:
        raise AudioError("is empty")
    try:
        f = sf.SoundFile(io.BytesIO(data))
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError):
        raise AudioError("is not audio that can be read (WAV, FLAC, OGG, MP3 and other libsndfile formats)") from None
    with f:
        rate, channels, declared = int(f.samplerate), int(f.channels), int(f.frames)
        if rate <= 0 or channels <= 0:
            raise AudioError("is not audio that can be read (its header gives no sample rate or channels)")
        _check_length(declared / rate, max_sec)
        if f.format in ("WAV", "WAVEX"):
            _check_wav_data_chunk(data)
        try:
            x = f.read(dtype="float32", always_2d=True)
        except (sf.LibsndfileError, RuntimeError) as exc:
            raise AudioError(f"is damaged or cut short ({str(exc).rsplit(':', 1)[-1].strip()})") from None
        fmt, subtype = str(f.format), str(f.subtype)
    got = int(x.shape[0])
    if declared > 0 and got + max(4096, declared // 100) < declared:
        raise AudioError(f"is cut short: its header promises {declared} frames, it holds {got}")
    if got == 0:
        raise AudioError("is empty: it holds no audio frames")
    x = np.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
    x = downmix(x)
    if rate != SAMPLE_RATE:
        import soxr

        x = soxr.resample(np.clip(x, -1.0, 1.0), rate, SAMPLE_RATE, quality="HQ")
    out = np.ascontiguousarray(np.clip(x, -1.0, 1.0, dtype=np.float32).T)
    facts = AudioFacts(fmt, subtype, rate, channels, got, int(out.shape[1]))
    if facts.samples < MIN_SAMPLES:
        raise AudioError(f"is too short: {facts.duration_sec * 1000:.0f} ms, less than one frame of the codec "
                         f"({MIN_SAMPLES / SAMPLE_RATE * 1000:.0f} ms)")  # fmt: skip
    _check_length(facts.duration_sec, max_sec)
    return out, facts


def _check_length(seconds: float, max_sec: float | None) -> None:
    if max_sec is not None and seconds > max_sec:
        raise AudioError(f"is {seconds:.1f} s long, longer than the longest song the model can continue "
                         f"({max_sec:.1f} s)")  # fmt: skip


def downmix(x: np.ndarray) -> np.ndarray:
    """(frames, channels) → (frames, 2): mono copied to both sides; beyond two channels, the first two
    are left and right and each other one goes to both at −3 dB, the sum scaled by 1 / (1 + 0.7071·(n − 2))."""
    n = x.shape[1]
    if n == 2:
        return x
    if n == 1:
        return np.repeat(x, 2, axis=1)
    rest = x[:, 2:].sum(axis=1, keepdims=True) * np.float32(np.sqrt(0.5))
    mixed: np.ndarray = (x[:, :2] + rest) / np.float32(1 + np.sqrt(0.5) * (n - 2))
    return mixed


def _check_wav_data_chunk(data: bytes) -> None:
    """A RIFF WAV whose ``data`` chunk says more bytes than follow it is cut short (libsndfile reads what
    is there without a word). Sizes 0 and 0xFFFFFFFF mean "unknown" (streamed files) and are not checked."""
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return
    pos = 12
    while pos + 8 <= len(data):
        cid, size = data[pos : pos + 4], struct.unpack_from("<I", data, pos + 4)[0]
        if cid == b"data":
            have = len(data) - pos - 8
            if size not in (0, 0xFFFFFFFF) and have < size:
                raise AudioError(f"is cut short: its data chunk promises {size} bytes, {have} follow")
            return
        pos += 8 + size + (size & 1)
