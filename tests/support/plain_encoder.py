"""An independent, plain codec encoder: torch's own ``weight_norm`` and float64 distances, written from the
release's layout, so the tests compare the pipeline's encoder with something that shares none of its code.
Its residual units (``Snake``, ``Unit``) build the plain decoder of tests/model/test_release_decoder.py too."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

from songserve.pipeline.tiny.decoder_release import ReleaseDecoderSizes


class Snake(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, c, 1))

    def forward(self, x):
        return x + torch.sin(self.alpha * x) ** 2 / (self.alpha + 1e-9)


class Unit(nn.Module):
    def __init__(self, c: int, dilation: int) -> None:
        super().__init__()
        self.block = nn.Sequential(
            Snake(c),
            weight_norm(nn.Conv1d(c, c, 7, dilation=dilation, padding=3 * dilation)),
            Snake(c),
            weight_norm(nn.Conv1d(c, c, 1)),
        )

    def forward(self, x):
        return x + self.block(x)


def _plain_encoder(s: ReleaseDecoderSizes) -> nn.Module:
    width = s.encoder_filters
    layers: list[nn.Module] = [weight_norm(nn.Conv1d(s.input_channel, width, 7, padding=3))]
    for stride in s.strides:
        half, width = width, 2 * width
        block = nn.Module()
        block.block = nn.Sequential(
            *(Unit(half, d) for d in (1, 3, 9)),
            Snake(half),
            weight_norm(nn.Conv1d(half, width, 2 * stride, stride=stride, padding=math.ceil(stride / 2))),
        )
        block.forward = block.block.forward  # type: ignore[method-assign]
        layers.append(block)
    layers += [Snake(width), weight_norm(nn.Conv1d(width, s.d_latent, 3, padding=1))]
    return nn.ModuleDict({"block": nn.Sequential(*layers)})


@torch.no_grad()
def plain_codes(s: ReleaseDecoderSizes, ckpt, audio: np.ndarray) -> np.ndarray:
    sd = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    enc = _plain_encoder(s)
    mine = {}
    for k in enc.state_dict():
        src = k.replace(".parametrizations.weight.original0", ".weight_g")
        mine[k] = sd[f"generator.encoder.{src.replace('.parametrizations.weight.original1', '.weight_v')}"]
    enc.load_state_dict(mine, strict=True)
    z = enc["block"](torch.from_numpy(audio)[None].float())[0].t().double()  # (frames, dim)
    codes = []
    for i in range(s.num_quantizers):
        book = sd[f"generator.quantizer.vq_layer_{i}._codebook.embed"].double()
        idx = ((z[:, None, :] - book[None]) ** 2).sum(-1).argmin(1)
        codes.append(idx)
        z = z - book[idx]
    return torch.stack(codes).numpy()
