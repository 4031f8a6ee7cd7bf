"""The codec's encoder from the release's files: the code grid ``DacRVQ.encode`` gives, frames and all.

The release-shaped check compares our loader and encoder with a straightforward one written here:
torch's own weight-norm parametrisation over DAC's encoder tree, fed from the same checkpoint, and
each level's code picked as the argmin of the squared distance in float64. The reference's own
code is compared by ``bench/encoder_vs_reference.py`` (it needs the reference's snapshot).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from songserve.audio.reading import read_audio
from songserve.errors import ConfigError
from songserve.pipeline.checkpoints.encoder_config import EncoderConfig, read_encoder_config
from songserve.pipeline.stages.encoder import load_encoder
from songserve.pipeline.tiny.build import RELEASE_LAYOUT
from songserve.pipeline.tiny.decoder_release import ReleaseDecoderSizes, write_release_decoder
from tests.support.audio import music, wav_bytes
from tests.support.plain_encoder import plain_codes

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    d = tmp_path_factory.mktemp("release_encoder")
    write_release_decoder(d / "dac.yaml", d / "dac.ckpt")
    return d / "dac.yaml", d / "dac.ckpt"


# ---- the release's files ----------------------------------------------------------------------------


def test_release_encoder_gives_the_plain_encoders_codes(release):
    pcm, facts = read_audio(wav_bytes(music(3.0)))
    assert facts.samples == pcm.shape[1] == 3 * 44100
    enc = load_encoder(*release, CPU)
    ours = enc.encode(torch.from_numpy(pcm), chunk_frames=0).numpy()
    plain = plain_codes(ReleaseDecoderSizes(), release[1], pcm)
    assert ours.shape == plain.shape == (64, 3 * 44100 // 2048)
    assert len(np.unique(ours[0])) > 20  # the codes move with the audio
    share = float((ours == plain).mean())
    print(f"codes equal to the plain float64 encoder: {share:.6f}")
    assert share >= 0.99  # float32 against float64: only near-ties may differ
    assert np.array_equal(ours[:4], plain[:4])


def test_chunked_encoding_gives_the_one_pass_codes(release):
    pcm, _ = read_audio(wav_bytes(music(4.0)))
    enc = load_encoder(*release, CPU)
    whole = enc.encode(torch.from_numpy(pcm), chunk_frames=0)
    seen: list[tuple[int, int]] = []
    chunked = enc.encode(
        torch.from_numpy(pcm), chunk_frames=20, context_frames=16, on_chunk=lambda d, n: seen.append((d, n))
    )
    assert seen[-1] == (5, 5)
    assert float((whole == chunked).float().mean()) >= 0.999


@pytest.mark.parametrize("samples", [2048, 2049, 4095, 4096, 8 * 44100 + 17])
def test_frames_are_the_encoders_own_count(release, samples):
    cfg = read_encoder_config(release[0])
    assert cfg == EncoderConfig(n_filters=2, d_latent=32)
    enc = load_encoder(*release, CPU)
    got = enc.encode(torch.zeros(2, samples), chunk_frames=0)
    assert got.shape == (64, cfg.frames(samples)) == (64, samples // 2048)
    assert EncoderConfig(strides=(3, 5)).frames(100) == 6  # odd strides: ⌊(L + 1) / s⌋ per block: 33, then 6


def test_silence_encodes(release):
    codes = load_encoder(*release, CPU).encode(torch.zeros(2, 40 * 2048))
    assert codes.shape == (64, 40)
    inner = codes[:, 12:28]  # away from the edges, where the convolutions see their zero padding
    assert (inner == inner[:, :1]).all()  # the same frame, the same codes


def test_the_project_tiny_set_carries_an_encoder(tiny_dir):
    enc = load_encoder(tiny_dir / "decoder" / "config.yaml", tiny_dir / "decoder" / "model.pth", CPU)
    assert enc.cfg.strides == (4, 8, 8, 8)
    assert enc.cfg.hop == 2048
    codes = enc.encode(torch.from_numpy(read_audio(wav_bytes(music(1.0)))[0]))
    assert codes.shape == (64, 21)
    assert 0 <= int(codes.min())
    assert int(codes.max()) < 1024


def test_the_release_shaped_set_loads_its_encoder(release_dir):
    enc = load_encoder(
        release_dir / RELEASE_LAYOUT["decoder_config"], release_dir / RELEASE_LAYOUT["decoder_checkpoint"], CPU
    )
    assert enc.cfg.d_latent == 32


# ---- refusals ---------------------------------------------------------------------------------------


def _blob(ckpt):
    return torch.load(ckpt, map_location="cpu", weights_only=True)


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (
            lambda sd: sd.pop("generator.encoder.block.1.block.0.block.1.weight_g"),
            "lacks 'generator.encoder.block.1.block.0.block.1.weight_g'",
        ),
        (
            lambda sd: sd.pop("generator.quantizer.vq_layer_9._codebook.embed"),
            "lacks 'generator.quantizer.vq_layer_9._codebook.embed'",
        ),
        (
            lambda sd: sd.update({"generator.encoder.block.9.bias": torch.zeros(2)}),
            "has the key 'generator.encoder.block.9.bias'",
        ),
        (
            lambda sd: sd.update({"generator.encoder.block.6.bias": torch.zeros(5)}),
            "'generator.encoder.block.6.bias' has shape",
        ),
    ],
)
def test_a_checkpoint_that_does_not_fit_refuses_naming_the_key(tmp_path, release, edit, says):
    blob = _blob(release[1])
    edit(blob["state_dict"])
    torch.save(blob, tmp_path / "bad.ckpt")
    with pytest.raises(ConfigError, match=says.replace(".", r"\.").replace("(", r"\(")) as err:
        load_encoder(release[0], tmp_path / "bad.ckpt", CPU)
    assert "\n" not in str(err.value)


def test_a_dac_format_file_has_no_encoder_here(tmp_path, release):
    torch.save({"state_dict": {}, "metadata": {"kwargs": {}}}, tmp_path / "dac.pth")
    with pytest.raises(ConfigError, match="DAC's own format"):
        load_encoder(release[0], tmp_path / "dac.pth", CPU)


# ---- residency: the encoder lives where RUNTIME_MODE keeps the decoder ------------------------------


def _residency(mode: str, config, ckpt):
    from types import SimpleNamespace

    from songserve.pipeline.residency import Residency

    s = SimpleNamespace(
        runtime_mode=mode,
        trust_checkpoint_pickle=False,
        park_backbone="0",
        encode_chunk_frames=8,
        encode_context_frames=16,
    )
    files = SimpleNamespace(decoder_config=config, decoder_checkpoint=ckpt)
    return s, Residency(s, files, CPU, phase=lambda _: None)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["one_shot", "keep_loaded", "park"])
def test_the_encoder_lives_where_the_runtime_mode_keeps_the_decoder(release, mode):
    from songserve.pipeline.context import TaskContext
    from songserve.pipeline.encoding import encode_audio

    s, r = _residency(mode, *release)
    r._check_encoder()  # what Residency.load does at start-up
    assert r.encoder_error is None
    if mode == "one_shot":
        r._unload_stage2()
    if mode == "park":
        r._park("encoder")
    pcm = read_audio(wav_bytes(music(1.0)))[0]
    ctx = TaskContext("upload-x")
    got = encode_audio(r, s, pcm, ctx)
    assert got.codes.shape == (64, 21)
    assert got.codes.dtype == np.int16
    assert ctx.snapshot().phase == "encoding"
    assert ctx.snapshot().detail == "chunk 3/3"  # 21 frames in chunks of 8
    whole = load_encoder(*release, CPU).encode(torch.from_numpy(pcm), chunk_frames=0).numpy()
    assert np.array_equal(got.codes, whole)
    assert (r.encoder is None) == (mode == "one_shot")
    assert ("encoder" in r.parked) == (mode == "park")
    assert r.status()["encoder_loaded"] == (mode != "one_shot")


def test_a_set_without_an_encoder_serves_songs_and_says_why_it_cannot_encode(tmp_path, release):
    from songserve.errors import UnavailableError

    blob = _blob(release[1])
    for k in [k for k in blob["state_dict"] if k.startswith("generator.encoder.")]:
        del blob["state_dict"][k]
    torch.save(blob, tmp_path / "decoder_only.ckpt")
    _, r = _residency("keep_loaded", release[0], tmp_path / "decoder_only.ckpt")
    r._check_encoder()
    assert r.encoder is None
    assert "lacks 'generator.encoder.block.0.weight_v'" in (r.encoder_error or "")
    with pytest.raises(UnavailableError, match="This worker cannot encode audio: Decoder checkpoint"):
        r.enter_encoder()
