"""Write a decoder in the published release's formats: its YAML schema and a Lightning checkpoint.

Used by the release-shaped tiny set (``tiny --layout release``), by tests (also at full size) and by
``bench/p13_decoder_load.py``. The checkpoint has the release's key names: ``generator.encoder.*`` and
``generator.decoder.*`` as DAC's weight-normed modules (``weight_g``/``weight_v``),
``generator.quantizer.vq_layer_{i}._codebook.{inited,cluster_size,embed,embed_avg}`` and
``generator.quantizer.embed_{i}`` (EnCodec-style EMA codebooks), a few ``discriminator.*`` tensors,
and Lightning's training entries (epoch, loops, callbacks, optimizer and scheduler states) as plain
data only, so it loads with ``weights_only=True``. Deterministic for a given seed.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from songserve.pipeline.checkpoints.decoder_config import DecoderConfig
from songserve.pipeline.numbers import CODEBOOK, SUPERRES_LEVELS
from songserve.pipeline.stages.codec import AudioDecoder


@dataclass(frozen=True)
class ReleaseDecoderSizes:
    """Widths of a release-schema decoder; the defaults are the tiny set's (64 × 1,024 codebooks, hop 2,048)."""

    input_channel: int = 2
    encoder_filters: int = 2
    strides: tuple[int, ...] = (4, 8, 8, 8)
    d_latent: int = 32
    decoder_filters: int = 4
    rates: tuple[int, ...] = (8, 8, 8, 4)
    out_channel: int = 2
    num_quantizers: int = SUPERRES_LEVELS
    codebook_size: int = CODEBOOK

    def decoder_config(self) -> DecoderConfig:
        return DecoderConfig(
            latent_dim=self.d_latent,
            n_filters=self.decoder_filters,
            rates=self.rates,
            channels=self.out_channel,
            n_codebooks=self.num_quantizers,
            codebook_size=self.codebook_size,
        )


FULL_SIZES = ReleaseDecoderSizes(encoder_filters=128, d_latent=128, decoder_filters=192)  # the golden YAML's widths


def release_yaml(s: ReleaseDecoderSizes) -> str:
    """The release's YAML, laid out as ``models/Decoder/dac_rvq_1024_64_golden.yaml`` is (comment,
    blank lines, interpolation, ``q_dropout: False``, no final newline): at ``FULL_SIZES`` it is that
    file byte for byte (tests/model/test_release_files.py holds the file and checks it)."""
    return (
        "# model config\n"
        "encoder:\n"
        f"  input_channel: {s.input_channel}\n"
        f"  n_filters: {s.encoder_filters}\n"
        f"  strides: [{', '.join(map(str, s.strides))}]\n"
        f"  d_latent: {s.d_latent}\n"
        "\n"
        "decoder:\n"
        f"  d_latent: {s.d_latent}\n"
        f"  n_filters: {s.decoder_filters}\n"
        f"  rates: [{', '.join(map(str, s.rates))}]\n"
        f"  out_channel: {s.out_channel}\n"
        "\n"
        "quantizer:\n"
        "  dim: ${encoder.d_latent}\n"
        f"  codebook_size: {s.codebook_size}\n"
        f"  num_quantizers: {s.num_quantizers}\n"
        "  decay: 0.99\n"
        "  q_dropout: False"
    )


def encoder_shapes(s: ReleaseDecoderSizes) -> dict[str, tuple[int, ...]]:
    """DAC's encoder module tree (plain weights; weight norm is applied when writing)."""
    out: dict[str, tuple[int, ...]] = {}

    def conv(name: str, cin: int, cout: int, k: int) -> None:
        out[f"{name}.weight"], out[f"{name}.bias"] = (cout, cin, k), (cout,)

    def residual(name: str, c: int) -> None:
        out[f"{name}.block.0.alpha"] = (1, c, 1)
        conv(f"{name}.block.1", c, c, 7)
        out[f"{name}.block.2.alpha"] = (1, c, 1)
        conv(f"{name}.block.3", c, c, 1)

    width = s.encoder_filters
    conv("encoder.block.0", s.input_channel, width, 7)
    for i, stride in enumerate(s.strides):
        width *= 2
        base = f"encoder.block.{i + 1}.block"
        for j in range(3):
            residual(f"{base}.{j}", width // 2)
        out[f"{base}.3.alpha"] = (1, width // 2, 1)
        conv(f"{base}.4", width // 2, width, 2 * stride)
    n = len(s.strides)
    out[f"encoder.block.{n + 1}.alpha"] = (1, width, 1)
    conv(f"encoder.block.{n + 2}", width, s.d_latent, 3)
    return out


def _random(shape: tuple[int, ...], name: str, gen: torch.Generator) -> torch.Tensor:
    if name.endswith(".alpha"):
        return 1.0 + 0.1 * torch.rand(shape, generator=gen)
    if name.endswith(".bias"):
        return 0.01 * torch.randn(shape, generator=gen)
    fan_in = math.prod(shape[1:])
    return torch.randn(shape, generator=gen) / math.sqrt(fan_in)


def _weight_normed(name: str, w: torch.Tensor, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """(g, v) with g ≠ ‖v‖, so a loader that ignores g is caught; dim 0, as torch's weight_norm."""
    base = name[: -len(".weight")]
    norm = w.flatten(1).norm(dim=1).view(-1, *([1] * (w.dim() - 1)))
    g = norm * (0.5 + torch.rand(norm.shape, generator=gen))
    return {f"{base}.weight_g": g, f"{base}.weight_v": w}


def _decoder_scale(name: str, last: str) -> float:
    """Damp the residual branches and the output conv, so activations of the untrained network stay
    O(1) through the stages (float32 then matches a float64 decode to ~1e-6) and the output near ±1."""
    if name == last:
        return 0.5
    if re.search(r"\.block\.[234]\.block\.3\.weight$", name):
        return 0.2
    return 1.0


def encoder_state(s: ReleaseDecoderSizes, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The ``generator.encoder.*`` tensors, weight-normed, drawn from ``gen`` (also the project's tiny set's)."""
    state: dict[str, torch.Tensor] = {}
    for name, shape in encoder_shapes(s).items():
        t = _random(shape, name, gen)
        parts = _weight_normed(name, t, gen) if name.endswith(".weight") and t.dim() == 3 else {name: t}
        state.update({f"generator.{k}": v for k, v in parts.items()})
    return state


def generator_state(s: ReleaseDecoderSizes, seed: int) -> dict[str, torch.Tensor]:
    """The ``generator.*`` tensors of a release checkpoint, seeded."""
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}

    def add(name: str, t: torch.Tensor) -> None:
        if name.endswith(".weight") and t.dim() == 3:
            state.update({f"generator.{k}": v for k, v in _weight_normed(name, t, gen).items()})
        else:
            state[f"generator.{name}"] = t

    state.update(encoder_state(s, gen))
    with torch.device("meta"):
        decoder_shapes = {k: tuple(v.shape) for k, v in AudioDecoder(s.decoder_config()).decoder.state_dict().items()}
    for name, shape in decoder_shapes.items():
        add(f"decoder.{name}", _random(shape, name, gen) * _decoder_scale(name, list(decoder_shapes)[-2]))
    for i in range(s.num_quantizers):
        embed = 0.3 * torch.randn(s.codebook_size, s.d_latent, generator=gen) / math.sqrt(1 + i)
        cluster = 1.0 + torch.rand(s.codebook_size, generator=gen)
        q = f"quantizer.vq_layer_{i}._codebook"
        add(f"{q}.inited", torch.ones(1))
        add(f"{q}.cluster_size", cluster)
        add(f"{q}.embed", embed)
        add(f"{q}.embed_avg", embed * cluster[:, None])
    for i in range(s.num_quantizers):
        add(f"quantizer.embed_{i}", state[f"generator.quantizer.vq_layer_{i}._codebook.embed"].clone())
    return state


def _training_entries(gen_state: dict[str, torch.Tensor], seed: int) -> dict[str, Any]:
    """Lightning's non-model entries, plain data only (what a weights-only load accepts)."""
    gen = torch.Generator().manual_seed(seed + 1)
    disc = {
        "discriminator.mpd.discriminators.0.convs.0.weight_g": torch.rand(4, 1, 1, generator=gen),
        "discriminator.mpd.discriminators.0.convs.0.weight_v": torch.randn(4, 1, 5, 1, generator=gen),
        "discriminator.mpd.discriminators.0.convs.0.bias": torch.zeros(4),
        "discriminator.msd.discriminators.0.conv_post.weight_g": torch.rand(1, 1, 1, generator=gen),
        "discriminator.msd.discriminators.0.conv_post.weight_v": torch.randn(1, 4, 3, generator=gen),
    }
    adam = {
        "state": {
            0: {"step": torch.tensor(2490000.0), "exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(4)},
        },
        "param_groups": [{"lr": 1e-4, "betas": (0.8, 0.99), "eps": 1e-8, "weight_decay": 0.0, "params": [0]}],
    }
    return {
        "epoch": 87,
        "global_step": 2490000,
        "pytorch-lightning_version": "2.1.3",
        "state_dict": {**gen_state, **disc},
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 88, "completed": 87}}}},
        "callbacks": {"ModelCheckpoint{'monitor': None, 'mode': 'min'}": {"best_model_score": None, "dirpath": "ckpt"}},
        "optimizer_states": [adam, adam],
        "lr_schedulers": [{"gamma": 0.999996, "last_epoch": 2490000, "base_lrs": [1e-4]}],
        "hparams_name": "configs",
    }


def write_release_decoder(
    yaml_path: Path, ckpt_path: Path, *, seed: int = 1283, sizes: ReleaseDecoderSizes | None = None
) -> None:
    """Write the release-schema YAML and a Lightning-style checkpoint with the release's key names."""
    s = sizes or ReleaseDecoderSizes()
    yaml_path.parent.mkdir(parents=True, exist_ok=True)
    ckpt_path.parent.mkdir(parents=True, exist_ok=True)
    blob = _training_entries(generator_state(s, seed), seed)
    tmp = yaml_path.with_name(f".{yaml_path.name}.tmp")
    tmp.write_text(release_yaml(s))
    os.replace(tmp, yaml_path)
    tmp = ckpt_path.with_name(f".{ckpt_path.name}.tmp")
    with open(tmp, "wb") as f:  # a file object: the archive's inner name does not depend on the file's
        torch.save(blob, f)
    os.replace(tmp, ckpt_path)
