"""The decoder as released: the reference YAML schema, its quantizer keys, Lightning checkpoints.

The full-size check compares our loader and fused decoder with a straightforward DAC decoder
written here with torch's own weight-norm parametrisation, fed from the same file.
"""

from __future__ import annotations

import logging
import math
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

from songserve.errors import ConfigError
from songserve.pipeline.checkpoints.decoder_config import read_decoder_config
from songserve.pipeline.checkpoints.decoder_load import TRUST_SETTING
from songserve.pipeline.stages.codec import load_decoder
from songserve.pipeline.tiny.decoder_release import FULL_SIZES, ReleaseDecoderSizes, release_yaml, write_release_decoder
from tests.support.plain_encoder import Snake, Unit

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    d = tmp_path_factory.mktemp("release_decoder")
    write_release_decoder(d / "dac.yaml", d / "dac.ckpt")
    return d / "dac.yaml", d / "dac.ckpt"


def _blob(ckpt):
    return torch.load(ckpt, map_location="cpu", weights_only=True)


# ---- an independent, plain DAC decoder (torch's weight_norm, no folding) ----------------------------


def _plain_decoder(s: ReleaseDecoderSizes) -> nn.Module:
    width = s.decoder_filters * 2 ** len(s.rates)
    layers: list[nn.Module] = [weight_norm(nn.Conv1d(s.d_latent, width, 7, padding=3))]
    for r in s.rates:
        block = nn.Module()  # DAC names its upsampling stages' contents ``block``
        block.block = nn.Sequential(
            Snake(width),
            weight_norm(nn.ConvTranspose1d(width, width // 2, 2 * r, stride=r, padding=math.ceil(r / 2))),
            *(Unit(width // 2, d) for d in (1, 3, 9)),
        )
        block.forward = block.block.forward  # type: ignore[method-assign]
        layers.append(block)
        width //= 2
    layers += [Snake(width), weight_norm(nn.Conv1d(width, s.out_channel, 7, padding=3))]
    dec = nn.Sequential(*layers)
    return nn.ModuleDict({"model": dec})


def _plain_from_file(s: ReleaseDecoderSizes, ckpt) -> tuple[nn.Module, list[torch.Tensor]]:
    sd = _blob(ckpt)["state_dict"]
    with torch.device("meta"):
        dec = _plain_decoder(s)
    mine = {}
    for k in dec.state_dict():
        src = k.replace(".parametrizations.weight.original0", ".weight_g").replace(
            ".parametrizations.weight.original1", ".weight_v"
        )
        mine[k] = sd[f"generator.decoder.{src}"]
    dec.load_state_dict(mine, strict=True, assign=True)
    books = [sd[f"generator.quantizer.vq_layer_{i}._codebook.embed"] for i in range(s.num_quantizers)]
    return dec.eval(), books


@torch.no_grad()
def _plain_decode(
    dec: nn.Module, books: list[torch.Tensor], codes: torch.Tensor, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """By default in float64: the truth our float32 path is held to."""
    dec = dec.to(dtype)
    z = sum(books[i].to(dtype)[codes[:, i]] for i in range(codes.shape[1]))  # (B, frames, latent)
    return dec["model"](z.transpose(1, 2)).float()


# ---- YAML -------------------------------------------------------------------------------------------


def test_release_yaml_with_interpolation_gives_the_codec_shape(release):
    cfg = read_decoder_config(release[0])
    assert (cfg.latent_dim, cfg.n_filters, cfg.rates, cfg.channels) == (32, 4, (8, 8, 8, 4), 2)
    assert (cfg.n_codebooks, cfg.codebook_size, cfg.hop, cfg.final_tanh) == (64, 1024, 2048, False)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (("  rates: [8, 8, 8, 4]\n", ""), "missing the key 'decoder.rates'"),
        (("${encoder.d_latent}", "${encoder.d_latnt}"), r"key 'quantizer.dim' refers to \$\{encoder.d_latnt\}"),
        (("  out_channel: 2", "  out_channel: two"), "key 'decoder.out_channel' must be a non-negative integer"),
        (("${encoder.d_latent}", "16"), r"'quantizer.dim' \(16\) must equal 'decoder.d_latent' \(32\)"),
        (("  strides: [4, 8, 8, 8]", "  strides: 4"), "key 'encoder.strides' must be a list"),
        (("  d_latent: 32\n\ndecoder", "  d_latent: ${quantizer.dim}\n\ndecoder"), "circular reference"),
    ],
)
def test_bad_release_yaml_refuses_naming_file_and_key(tmp_path, edit, message):
    text = release_yaml(ReleaseDecoderSizes())
    assert edit[0] in text
    (tmp_path / "d.yaml").write_text(text.replace(edit[0], edit[1]))
    with pytest.raises(ConfigError, match=message) as err:
        read_decoder_config(tmp_path / "d.yaml")
    assert str(tmp_path / "d.yaml") in str(err.value)
    assert "\n" not in str(err.value)


def test_interpolation_inside_a_string_and_of_a_list(tmp_path):
    from songserve.pipeline.checkpoints.decoder_config import resolve_interpolations

    raw = {"a": {"b": 3, "l": [1, 2]}, "c": "x${a.b}y", "d": "${a.l}", "e": ["${a.b}"]}
    assert resolve_interpolations(raw, "f") == {"a": {"b": 3, "l": [1, 2]}, "c": "x3y", "d": [1, 2], "e": [3]}


# ---- checkpoint -------------------------------------------------------------------------------------


def test_release_checkpoint_decodes_with_the_vq_layers_codebooks(release):
    decoder = load_decoder(*release, CPU)
    assert not hasattr(decoder, "encoder")
    dec, books = _plain_from_file(ReleaseDecoderSizes(), release[1])
    for i in (0, 17, 63):
        assert torch.equal(decoder.quantizer.quantizers[i].codebook.weight, books[i])
    codes = torch.randint(0, 1024, (2, 64, 6), generator=torch.Generator().manual_seed(5))
    ours = decoder.decode(codes, chunk_frames=0)
    assert ours.shape == (2, 2, 6 * 2048)
    torch.testing.assert_close(ours, _plain_decode(dec, books, codes), atol=1e-5, rtol=0)


def test_write_release_decoder_is_deterministic(tmp_path, release):
    write_release_decoder(tmp_path / "x.yaml", tmp_path / "other_name.ckpt")
    assert (tmp_path / "other_name.ckpt").read_bytes() == release[1].read_bytes()
    assert (tmp_path / "x.yaml").read_text() == release[0].read_text()
    write_release_decoder(tmp_path / "y.yaml", tmp_path / "seed2.ckpt", seed=7)
    assert (tmp_path / "seed2.ckpt").read_bytes() != release[1].read_bytes()


@pytest.mark.parametrize(
    "key",
    [
        "generator.quantizer.vq_layer_5._codebook.embed_avg",
        "generator.quantizer.embed_63",
        "generator.decoder.model.0.weight_g",
    ],
)
def test_a_missing_key_refuses_naming_it(tmp_path, release, key):
    blob = _blob(release[1])
    del blob["state_dict"][key]
    torch.save(blob, tmp_path / "bad.ckpt")
    with pytest.raises(ConfigError, match=f"lacks the key '{key}'") as err:
        load_decoder(release[0], tmp_path / "bad.ckpt", CPU)
    assert "\n" not in str(err.value)


def test_a_left_over_decoder_key_refuses(tmp_path, release):
    blob = _blob(release[1])
    blob["state_dict"]["generator.decoder.model.99.bias"] = torch.zeros(2)
    torch.save(blob, tmp_path / "extra.ckpt")
    with pytest.raises(
        ConfigError,
        match="does not match .*: it has the key 'generator.decoder.model.99.bias', which the config does not use",
    ):
        load_decoder(release[0], tmp_path / "extra.ckpt", CPU)


def test_encoder_discriminator_and_training_entries_are_ignored(tmp_path, release):
    blob = _blob(release[1])
    sd = blob["state_dict"]
    for k in [k for k in sd if k.startswith("generator.encoder.")][::2]:
        sd[k] = torch.zeros(1)  # wrong shapes: never read
    sd["discriminator.extra.weight"] = torch.zeros(3)
    blob["optimizer_states"].append({"state": {}, "param_groups": []})
    torch.save(blob, tmp_path / "noisy.ckpt")
    codes = torch.randint(0, 1024, (1, 64, 3))
    a = load_decoder(release[0], tmp_path / "noisy.ckpt", CPU).decode(codes, 0)
    b = load_decoder(*release, CPU).decode(codes, 0)
    assert torch.equal(a, b)


def test_a_differing_embed_i_is_logged_and_decode_uses_codebook_embed(tmp_path, release, caplog):
    blob = _blob(release[1])
    blob["state_dict"]["generator.quantizer.embed_3"] = torch.zeros(1024, 32)
    torch.save(blob, tmp_path / "diff.ckpt")
    with caplog.at_level(logging.WARNING, logger="songserve.pipeline.checkpoints.decoder_load"):
        decoder = load_decoder(release[0], tmp_path / "diff.ckpt", CPU)
    assert "quantizer.embed_3 differs" in caplog.text
    emb = blob["state_dict"]["generator.quantizer.vq_layer_3._codebook.embed"]
    assert torch.equal(decoder.quantizer.quantizers[3].codebook.weight, emb)


class TrainerOnlyState:
    """Stands for the custom objects some Lightning files pickle (a trainer's callback state)."""

    def __init__(self) -> None:
        self.best = 0.5


def test_lightning_file_needing_unpickling_refuses_unless_trusted(tmp_path, release):
    blob = _blob(release[1])
    blob["callbacks"]["Custom"] = TrainerOnlyState()
    torch.save(blob, tmp_path / "pickled.ckpt")
    with pytest.raises(ConfigError, match=f"set {TRUST_SETTING}=1 to unpickle it fully") as err:
        load_decoder(release[0], tmp_path / "pickled.ckpt", CPU)
    assert "TrainerOnlyState" in str(err.value)
    assert "\n" not in str(err.value)
    decoder = load_decoder(release[0], tmp_path / "pickled.ckpt", CPU, trust_pickle=True)
    assert decoder.cfg.n_codebooks == 64


def test_plain_types_lightning_files_carry_load_without_opt_in(tmp_path, release):
    import argparse
    import datetime
    import pathlib

    import numpy as np

    blob = _blob(release[1])
    blob["hyper_parameters"] = {
        "ns": argparse.Namespace(lr=1e-4),
        "dir": pathlib.PosixPath("/ckpt"),
        "when": datetime.datetime(2026, 5, 1, 12, 0),
        "best": np.float64(0.25),
    }
    torch.save(blob, tmp_path / "plain.ckpt")
    assert load_decoder(release[0], tmp_path / "plain.ckpt", CPU).cfg.hop == 2048


def test_loading_builds_no_weights_on_a_real_device(release, monkeypatch):
    seen: list[str] = []
    real = torch.nn.init.kaiming_uniform_

    def spy(tensor, *a, **kw):
        seen.append(tensor.device.type)
        return real(tensor, *a, **kw)

    monkeypatch.setattr(torch.nn.init, "kaiming_uniform_", spy)
    load_decoder(*release, CPU)
    assert seen
    assert set(seen) == {"meta"}


@pytest.fixture
def ram_dir(tmp_path: Path) -> Iterator[Path]:
    """A folder in memory (the machine's /dev/shm tmpfs) where it has room, else ``tmp_path``: the
    full-size checkpoint is 1 GiB, which this machine's disk took ~10 s to write and its memory 1.4 s;
    what the test reads back is the file's content, which does not depend on where it lies."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or shutil.disk_usage(shm).free < 3 * 2**30:
        yield tmp_path
        return
    folder = Path(tempfile.mkdtemp(prefix="songserve-decoder-", dir=shm))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_full_size_decoder_matches_a_plain_weight_norm_implementation(ram_dir):
    """n_filters 192, 64 × 1,024 × 128, reference key names, strict; ≤ 1e-5 against the plain decoder."""
    write_release_decoder(ram_dir / "dac.yaml", ram_dir / "dac.ckpt", sizes=FULL_SIZES)
    decoder = load_decoder(ram_dir / "dac.yaml", ram_dir / "dac.ckpt", CPU)
    assert decoder.decoder.model[0].weight.shape == (3072, 128, 7)
    codes = torch.randint(0, 1024, (1, 64, 3), generator=torch.Generator().manual_seed(11))
    ours = decoder.decode(codes, chunk_frames=0)
    del decoder
    dec, books = _plain_from_file(FULL_SIZES, ram_dir / "dac.ckpt")
    ref = _plain_decode(dec, books, codes, torch.float32)  # float64 at this size costs seconds; ~3e-7 apart
    assert ours.shape == ref.shape == (1, 2, 3 * 2048)
    assert ref.abs().max() > 1e-3
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


def test_worker_refuses_a_pickled_decoder_then_serves_it_with_the_opt_in(tiny_dir, tmp_path, release):
    """Real worker processes: the refusal names the setting; with it set, a track decodes through HTTP."""
    import httpx

    from tests.support.http import TLS
    from tests.support.servers import start_worker, worker_refusal

    blob = _blob(release[1])
    blob["callbacks"]["Custom"] = TrainerOnlyState()
    torch.save(blob, tmp_path / "pickled.ckpt")
    flags = ["--checkpoints-dir", str(tiny_dir), "--decoder-config-path", str(release[0])]
    flags += ["--decoder-checkpoint-path", str(tmp_path / "pickled.ckpt")]
    out = worker_refusal(*flags)
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("worker: Decoder checkpoint")
    assert f"set {TRUST_SETTING}=1" in last

    w = start_worker(tmp_path, *flags, env={TRUST_SETTING: "1"}, name="trusting")
    try:
        w.wait_healthy()
        body = {"lyrics": "[verse]\nhello", "tags": "pop", "duration": 2 / 60, "seed_override": 3}
        r = httpx.post(w.url + "/generate", json=body, timeout=120, verify=TLS)
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "ok"
        assert r.json()["duration_sec"] > 0
        assert "full unpickling" in w.log_tail()
    finally:
        w.stop()
