"""The codec encoder's configuration, read from the same YAML as the decoder's (either schema).

- the release's schema: ``encoder: {input_channel, n_filters, strides, d_latent}`` (the keyword
  arguments of the reference's ``Encoder`` in dac.py, with its defaults 2, 128, [2, 4, 8, 8], 64
  where a key is absent) and the quantizer's ``num_quantizers``, ``codebook_size`` and ``dim``;
- the project's own schema: ``encoder: {n_filters, latent_dim, strides, input_channel}``, the strides
  defaulting to the decoder's rates reversed (what DAC and the release both do), the channels to the
  decoder's output channels.

The frame count a number of samples gives is computed here too (``EncoderConfig.frames``): the
encoder pads nothing beyond what its convolutions do, so it is a fact of the strides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from songserve.errors import ConfigError
from songserve.pipeline.checkpoints.decoder_config import _Fields, read_decoder_yaml, resolve_interpolations
from songserve.pipeline.numbers import CODEBOOK, SAMPLE_RATE, SUPERRES_LEVELS


@dataclass(frozen=True)
class EncoderConfig:
    input_channel: int = 2
    n_filters: int = 128  # the first convolution's width; each downsampling block doubles it
    strides: tuple[int, ...] = (4, 8, 8, 8)
    d_latent: int = 128
    n_codebooks: int = SUPERRES_LEVELS
    codebook_size: int = CODEBOOK
    sample_rate: int = SAMPLE_RATE

    @property
    def hop(self) -> int:
        return math.prod(self.strides)

    @property
    def frame_rate(self) -> float:
        return self.sample_rate / self.hop

    def frames(self, samples: int) -> int:
        """Frames the encoder gives for ``samples``: each block's convolution (kernel 2s, stride s,
        padding ⌈s/2⌉) maps L to ⌊(L + 2⌈s/2⌉ − 2s) / s⌋ + 1; the other layers keep the length.
        With even strides that is ⌊samples / hop⌋: a last partial frame is not encoded."""
        n = samples
        for s in self.strides:
            n = max(0, (n + 2 * math.ceil(s / 2) - 2 * s) // s + 1)
        return n

    @classmethod
    def from_yaml_dict(cls, raw: dict[str, Any], source: str) -> EncoderConfig:
        if not isinstance(raw, dict):
            raise ConfigError(f"Decoder config {source} is not a mapping.")
        f = _Fields(resolve_interpolations(raw, source), source)
        dec, q = f.section("decoder"), f.section("quantizer")
        f.section("encoder")
        if "rates" in dec or "num_quantizers" in q:  # the release's schema (decoder_config.RELEASE_KEYS)
            d_latent = f.integer("encoder.d_latent", 64)
            dim = f.integer("quantizer.dim")
            if dim != d_latent:
                raise ConfigError(
                    f"Decoder config {source}: key 'quantizer.dim' ({dim}) must equal 'encoder.d_latent' ({d_latent})."
                )
            return cls(
                input_channel=f.integer("encoder.input_channel", 2),
                n_filters=f.integer("encoder.n_filters", 128),
                strides=f.int_list("encoder.strides", (2, 4, 8, 8)),
                d_latent=d_latent,
                n_codebooks=f.integer("quantizer.num_quantizers"),
                codebook_size=f.integer("quantizer.codebook_size"),
            )
        rates = f.int_list("decoder.upsampling_ratios")
        return cls(
            input_channel=f.integer("encoder.input_channel", f.integer("decoder.output_channels", 2)),
            n_filters=f.integer("encoder.n_filters"),
            strides=f.int_list("encoder.strides", tuple(reversed(rates))),
            d_latent=f.integer("encoder.latent_dim", f.integer("quantizer.latent_dim")),
            n_codebooks=f.integer("quantizer.n_codebooks"),
            codebook_size=f.integer("quantizer.codebook_size"),
            sample_rate=f.integer("sample_rate", SAMPLE_RATE),
        )


def read_encoder_config(path: Path) -> EncoderConfig:
    """The encoder's part of a decoder YAML file (either schema); ``ConfigError`` naming the key otherwise."""
    return EncoderConfig.from_yaml_dict(read_decoder_yaml(path), str(path))
