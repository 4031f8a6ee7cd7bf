"""A person's audio file as the codec takes it (songserve/audio/reading.py): formats, rates, channels, refusals."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile as sf

from songserve.audio.reading import SAMPLE_RATE, AudioError, _Samples, check_audio, downmix, read_audio


def tone(seconds: float, rate: int, channels: int = 2, level: float = 0.4) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return np.stack([level * np.sin(2 * np.pi * 440 * (c + 1) * t) for c in range(channels)], 1)


def encoded(x: np.ndarray, rate: int, fmt: str = "WAV", subtype: str | None = None) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, x, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def test_a_stereo_44k_wav_is_its_samples():
    x = tone(1.0, SAMPLE_RATE)
    data = encoded(x, SAMPLE_RATE, subtype="PCM_16")
    pcm, facts = read_audio(data)
    assert pcm.shape == (2, SAMPLE_RATE)
    assert pcm.dtype == np.float32
    assert pcm.flags["C_CONTIGUOUS"]
    held = sf.read(io.BytesIO(data), dtype="int16")[0].T  # what the file holds, exactly: int / 32768
    assert np.array_equal(pcm, (held / 32768).astype(np.float32))
    assert (facts.format, facts.subtype, facts.sample_rate, facts.channels) == ("WAV", "PCM_16", 44100, 2)
    assert facts.extension == "wav"
    assert facts.duration_sec == 1.0


@pytest.mark.parametrize("rate", [22050, 48000, 16000])
def test_any_rate_is_resampled_to_44k(rate):
    pcm, facts = read_audio(encoded(tone(2.0, rate), rate))
    assert facts.sample_rate == rate
    assert abs(pcm.shape[1] - 2 * SAMPLE_RATE) <= 1
    spectrum = np.abs(np.fft.rfft(pcm[0]))
    assert abs(np.argmax(spectrum) * SAMPLE_RATE / pcm.shape[1] - 440) < 2  # the same pitch after resampling


@pytest.mark.parametrize(("fmt", "ext"), [("FLAC", "flac"), ("OGG", "ogg"), ("MP3", "mp3")])
def test_flac_ogg_and_mp3_are_read(fmt, ext):
    pcm, facts = read_audio(encoded(tone(2.0, 48000), 48000, fmt))
    assert facts.format == fmt
    assert facts.extension == ext
    assert abs(pcm.shape[1] - 2 * SAMPLE_RATE) < 2048
    assert 0.2 < np.abs(pcm).max() <= 1.0


def test_mono_is_copied_to_both_sides_and_many_channels_mixed_down_in_range():
    pcm, facts = read_audio(encoded(tone(1.0, SAMPLE_RATE, channels=1), SAMPLE_RATE))
    assert facts.channels == 1
    assert np.array_equal(pcm[0], pcm[1])
    six = np.ones((4096, 6), dtype=np.float32)  # full scale in every channel of a 5.1 file
    out = downmix(six)
    assert out.shape == (4096, 2)
    assert np.allclose(out, 1.0)
    pcm, facts = read_audio(encoded(tone(1.0, SAMPLE_RATE, channels=6, level=0.9), SAMPLE_RATE, subtype="FLOAT"))
    assert facts.channels == 6
    assert pcm.shape[0] == 2
    assert np.abs(pcm).max() <= 1.0


def test_clipped_and_broken_float_samples_stay_in_range():
    x = tone(1.0, SAMPLE_RATE, level=3.0)
    x[100] = np.nan
    pcm, _ = read_audio(encoded(x, SAMPLE_RATE, subtype="FLOAT"))
    assert np.abs(pcm).max() == 1.0
    assert np.isfinite(pcm).all()
    pcm, _ = read_audio(encoded(x[:, :1], 22050, subtype="FLOAT"))  # resampling a square-ish wave overshoots
    assert np.abs(pcm).max() <= 1.0


def test_silence_is_audio():
    pcm, facts = read_audio(encoded(np.zeros((SAMPLE_RATE, 2)), SAMPLE_RATE, subtype="PCM_16"))
    assert facts.samples == SAMPLE_RATE
    assert not pcm.any()


def _cut(data: bytes, keep: float) -> bytes:
    return data[: int(len(data) * keep)]


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"", "is empty"),
        (b"these are the lyrics of a song, not its audio\n" * 20, "is not audio that can be read"),
        (_cut(encoded(tone(1.0, SAMPLE_RATE), SAMPLE_RATE, subtype="PCM_16"), 0.5), "is cut short: its data chunk"),
        (_cut(encoded(tone(2.0, SAMPLE_RATE), SAMPLE_RATE, "FLAC"), 0.5), "is damaged or cut short"),
        (_cut(encoded(tone(4.0, SAMPLE_RATE), SAMPLE_RATE, "MP3"), 0.4), "is cut short: its header promises"),
        (encoded(np.zeros((0, 2)), SAMPLE_RATE, subtype="PCM_16"), "is empty"),
        (encoded(tone(0.02, SAMPLE_RATE), SAMPLE_RATE, subtype="PCM_16"), "is too short"),
    ],
)
def test_what_cannot_be_used_is_refused_saying_why(data, says):
    with pytest.raises(AudioError, match=says):
        read_audio(data)


def test_too_long_is_refused_from_the_header_before_decoding():
    with pytest.raises(
        AudioError, match=r"is 3.0 s long, longer than the longest song the model can continue \(2.5 s\)"
    ):
        read_audio(encoded(tone(3.0, 22050), 22050), max_sec=2.5)
    assert read_audio(encoded(tone(2.0, 22050), 22050), max_sec=2.5)[1].duration_sec == pytest.approx(2.0, abs=1e-4)


def test_a_header_promising_more_to_decode_than_the_length_allows_is_refused_naming_it():
    data = encoded(np.zeros((int(0.4 * 384_000), 8)), 384_000, "FLAC")  # 0.4 s: 1.2 M samples for a 0.5 s cap
    with pytest.raises(AudioError) as err:
        read_audio(data, max_sec=0.5)
    assert str(err.value) == (
        "would decode to 1,228,800 samples (0.4 s at 384000 Hz in 8 channels), more than the 768,000 an upload "
        "of at most 0.5 s may decode to (192000 Hz in 8 channels)"
    )
    assert read_audio(data, max_sec=1.0)[1].channels == 8  # within the cap for a longer length: decoded


def test_a_file_object_and_check_audio_read_as_the_bytes_do():
    data = encoded(tone(1.5, 48000, channels=6), 48000, "FLAC")
    pcm, facts = read_audio(data)
    f = io.BytesIO(data)
    f.seek(123)  # read from the start wherever it stands
    again, facts_again = read_audio(f)
    assert np.array_equal(pcm, again)
    assert facts == facts_again == check_audio(io.BytesIO(data))


def test_samples_are_kept_right_when_the_header_promised_more_or_fewer_frames():
    def block(start: int) -> np.ndarray:  # (10 frames, 2): left counts up from start, right down
        up = np.arange(start, start + 10, dtype=np.float32)
        return np.stack([up, -up], 1)

    fewer = _Samples()
    fewer.reserve(25)  # promised 25, holds 20: compacted in place
    fewer.add(block(0))
    fewer.add(block(10))
    out = fewer.result()
    assert out.shape == (2, 20)
    assert out.flags["C_CONTIGUOUS"]
    assert np.array_equal(out[0], np.arange(20))
    assert np.array_equal(out[1], -np.arange(20))
    more = _Samples()
    more.reserve(15)  # promised 15, holds 20: the rest kept apart, joined at the end
    more.add(block(0))
    more.add(block(10))
    out = more.result()
    assert np.array_equal(out[0], np.arange(20))
    assert np.array_equal(out[1], -np.arange(20))
