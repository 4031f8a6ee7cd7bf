"""A take's MP3 written through LAME: its tags, its Info frame, its length, its bitrate (pipeline/stages/mp3.py)."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from pydantic import ValidationError

from songserve.pipeline.stages import mp3
from songserve.pipeline.stages.export import Mp3Options, write_track
from songserve.worker.settings import WorkerSettings

SR = 44100


def _take(seconds: float = 3.3, channels: int = 2) -> np.ndarray:
    """A chord with a little noise (samples, channels) float32: what a take's export gets."""
    t = np.arange(int(SR * seconds)) / SR
    tones = [np.sin(2 * np.pi * f * t) for f in (220.0, 330.0)[:channels]]
    noise = np.random.default_rng(0).normal(0, 0.01, (t.size, channels))
    return (0.4 * np.stack(tones, 1) + noise).astype(np.float32)


def _export(tmp_path: Path, audio: np.ndarray, options: Mp3Options) -> tuple[Path, Path]:
    wav, mp3_name, _, _ = write_track(tmp_path, audio, SR, {}, options)
    return tmp_path / wav, tmp_path / mp3_name


def _bare(path: Path) -> bytes:
    """The frames of an MP3 file, its ID3v2 tag left out."""
    data = path.read_bytes()
    if data[:3] != b"ID3":
        return data
    size = sum(b << (7 * (3 - i)) for i, b in enumerate(data[6:10]))
    return data[10 + size :]


def test_the_compression_level_maps_to_the_largest_mpeg1_bitrate_under_its_ceiling():
    assert mp3.cbr_kbps(0.0) == 320
    assert mp3.cbr_kbps(0.1) == 256  # ceiling 291.2
    assert mp3.cbr_kbps(0.5) == 160  # ceiling 176
    assert mp3.cbr_kbps(1.0) == 32


def test_the_crc_is_lames_crc16():
    assert mp3.crc16(b"123456789") == 0xBB3D  # CRC-16/ARC's check value


@pytest.mark.parametrize(
    ("title", "lyrics"),
    [
        ("pop, piano (take 1)", "[verse]\nhello café"),
        ("民谣 (take 2)", "[verse]\n你好，世界\n月亮"),
        ("rock (take 1)", ""),
    ],
)
def test_the_tags_read_back_as_written(tmp_path, title, lyrics):
    _, path = _export(tmp_path, _take(), Mp3Options(title=title, lyrics=lyrics))
    tags = sf.SoundFile(path).copy_metadata()
    assert tags.get("title") == title
    assert tags.get("comment") == (lyrics or None)  # no lyrics: no COMM frame
    assert tags.get("software") == "songserve"


def test_text_that_fits_latin1_is_latin1_and_the_rest_utf16_with_a_bom():
    tag = mp3.id3v2_tag("café", "你好")
    assert tag[:5] == b"ID3\x03\x00"
    assert b"TIT2\x00\x00\x00\x05\x00\x00\x00caf\xe9" in tag
    assert b"COMM\x00\x00\x00\x0e\x00\x00\x01eng\xff\xfe\x00\x00\xff\xfe" + "你好".encode("utf-16-le") in tag
    assert mp3.id3v2_tag("", "", "") == b""


@pytest.mark.parametrize("channels", [2, 1])
@pytest.mark.parametrize("seconds", [3.3, 1152 * 5 / SR, 0.01, 0.0])
def test_the_mp3_decodes_to_the_wavs_length_without_a_lag(tmp_path, channels, seconds):
    wav, path = _export(tmp_path, _take(seconds, channels), Mp3Options())
    assert sf.info(path).frames == sf.info(wav).frames
    if seconds < 1:
        return
    ref, _ = sf.read(wav, always_2d=True)
    got, _ = sf.read(path, always_2d=True)
    lags = range(-4, 5)
    corr = [float(np.dot(got[100:-100, 0], ref[100 + lag : ref.shape[0] - 100 + lag, 0])) for lag in lags]
    assert lags[int(np.argmax(corr))] == 0
    assert np.corrcoef(got[:, 0], ref[:, 0])[0, 1] > 0.999


def test_level_0_is_320_kbit_s_and_the_info_frame_counts_frames_bytes_delay_and_padding(tmp_path):
    wav, path = _export(tmp_path, _take(), Mp3Options())
    stream = _bare(path)
    spans = list(mp3.frames(stream))
    assert {stream[o + 2] >> 4 for o, _ in spans} == {14}  # bitrate index 14: 320 kbit/s, every frame
    info = stream[36 : 36 + 156]
    assert info[:4] == b"Info"
    _, count, size = struct.unpack(">III", info[4:16])
    assert (count, size) == (len(spans) - 1, len(stream))
    assert info[120:124] == b"LAME"
    packed = int.from_bytes(info[141:144], "big")
    delay, padding = packed >> 12, packed & 0xFFF
    assert delay == 576
    assert count * 1152 - delay - padding == sf.info(wav).frames
    assert struct.unpack(">H", info[154:156])[0] == mp3.crc16(stream[: 36 + 154])
    assert struct.unpack(">H", info[152:154])[0] == mp3.crc16(stream[spans[1][0] :])


def test_a_higher_level_is_a_lower_constant_bitrate(tmp_path):
    wav, path = _export(tmp_path, _take(), Mp3Options(compression_level=0.5))
    stream = _bare(path)
    assert {stream[o + 2] >> 4 for o, _ in list(mp3.frames(stream))[1:]} == {10}  # 160 kbit/s
    assert sf.info(path).frames == sf.info(wav).frames


def test_the_same_audio_makes_the_same_bytes_whatever_the_block(tmp_path):
    pcm = (_take() * 32767).astype(np.int16)
    one = mp3.mp3_file(pcm, SR, 320, 3, "t", "l", SR, lambda share: None)
    assert mp3.mp3_file(pcm, SR, 320, 3, "t", "l", SR, lambda share: None) == one
    assert mp3.mp3_file(pcm, SR, 320, 3, "t", "l", 4321, lambda share: None) == one


def test_lame_gets_the_samples_the_wav_holds(tmp_path):
    wav, path = _export(tmp_path, _take(), Mp3Options(title="t", lyrics="l"))
    pcm, _ = sf.read(wav, dtype="int16")
    assert path.read_bytes() == mp3.mp3_file(pcm, SR, 320, 3, "t", "l", SR, lambda share: None)


def test_progress_reaches_the_whole_export(tmp_path):
    shares: list[float] = []
    write_track(tmp_path, _take(25.0), SR, {}, Mp3Options(), lambda share, what: shares.append(share))
    assert shares == sorted(shares)
    assert len(shares) >= 4
    assert shares[-1] == pytest.approx(1.0)


def test_variable_bitrate_stays_libsndfiles_writer(tmp_path):
    _, path = _export(tmp_path, _take(), Mp3Options(bitrate_mode="VARIABLE", title="t", lyrics="你好"))
    assert sf.SoundFile(path).copy_metadata()["comment"] == "你好"
    assert b"Xing" in _bare(path)[:200]  # libsndfile's LAME marks a variable bitrate stream so


@pytest.mark.parametrize("quality", [-1, 10])
def test_mp3_quality_is_lames_0_to_9(quality, monkeypatch):
    monkeypatch.setenv("MP3_QUALITY", str(quality))
    with pytest.raises(ValidationError):
        WorkerSettings()


def test_mp3_quality_defaults_to_lames_own_3():
    assert WorkerSettings.model_fields["mp3_quality"].default == mp3.DEFAULT_QUALITY == 3
