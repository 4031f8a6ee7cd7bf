"""The codec's encoder: 44.1 kHz stereo samples → the 64-level code grid the models continue from.

Written in the project, as the decoder is (``codec.py``), from these facts of the reference
(``models/Decoder/dac.py``, ``rvq.py``, ``dac_rvq.py`` in its snapshot):
- ``DacRVQ.encode(x)`` runs ``Encoder`` on ``(B, 2, samples)`` — a 7-wide convolution, one block per
  stride (three residual units with dilations 1, 3, 9, Snake, a convolution of kernel 2s and stride
  s that doubles the width), Snake, a 3-wide convolution to the latent — then the quantizer's
  *forward*, whose codes are those of its ``encode``: level by level, the codebook entry nearest the
  residual by the squared distance ``|x|² − 2·x·Eᵀ + |E|²`` (the first index of its negation's
  maximum on a tie), then the residual minus that entry. Its extras change no code: the commitment
  loss is only returned, k-means runs only for a level whose ``inited`` is 0 (never in a trained
  file), EMA updates only while training.
- No padding of its own: ``frames = EncoderConfig.frames(samples)``, ⌊samples / 2048⌋ at the release's
  strides.
The distance is computed with the very expression the reference uses, on the same layouts, so a
code differs only where two entries are within float rounding of each other (a near-tie); the
weights are the reference's bits (``checkpoints/encoder_load.py``).

Long audio is encoded in chunks of ``chunk_frames`` with ``context_frames`` of audio on each side
(the encoder sees about 8 frames either way), which bounds memory; audio that fits one chunk is
encoded in one pass, as the reference does.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from songserve.pipeline.checkpoints.encoder_config import EncoderConfig, read_encoder_config
from songserve.pipeline.checkpoints.encoder_load import encoder_tensors
from songserve.pipeline.stages.codec import ResidualUnit, Snake1d, materialise

log = logging.getLogger(__name__)


class EncoderBlock(nn.Module):
    def __init__(self, dim: int, stride: int) -> None:
        super().__init__()
        half = dim // 2
        self.block = nn.Sequential(
            ResidualUnit(half, 1),
            ResidualUnit(half, 3),
            ResidualUnit(half, 9),
            Snake1d(half),
            nn.Conv1d(half, dim, 2 * stride, stride=stride, padding=math.ceil(stride / 2)),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class Encoder(nn.Module):
    """DAC's encoder tree (``block.0`` … ``block.{n+2}``), so the checkpoint's keys line up."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        width = cfg.n_filters
        layers: list[nn.Module] = [nn.Conv1d(cfg.input_channel, width, 7, padding=3)]
        for stride in cfg.strides:
            width *= 2
            layers.append(EncoderBlock(width, stride))
        layers += [Snake1d(width), nn.Conv1d(width, cfg.d_latent, 3, padding=1)]
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class AudioEncoder(nn.Module):
    """Encoder + the quantizer's code picking; ``encode`` turns (channels, samples) into (n_q, frames)."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder(cfg)
        self.codebooks = nn.Parameter(
            torch.empty(cfg.n_codebooks, cfg.codebook_size, cfg.d_latent), requires_grad=False
        )  # (n_q, size, dim)
        self._norms: list[torch.Tensor] = []  # per level |E|² as (1, size), computed once

    def norms(self) -> list[torch.Tensor]:
        """Each codebook's squared entry norms, as the reference computes them (``embed.t().pow(2).sum(0)``)."""
        if not self._norms or self._norms[0].device != self.codebooks.device:
            self._norms = [book.t().pow(2).sum(0, keepdim=True) for book in self.codebooks]
        return self._norms

    def quantize(self, z: torch.Tensor) -> torch.Tensor:
        """z (frames, dim) → codes (n_q, frames): per level the nearest entry to the residual, then the
        residual minus it (rvq.py's ``EuclideanCodebook.quantize`` and ``ResidualVectorQuantization``)."""
        residual, codes = z.contiguous(), []
        for book, sq in zip(self.codebooks, self.norms(), strict=True):
            embed = book.t()  # (dim, size), a view, as the reference's ``self.embed.t()``
            dist = -(residual.pow(2).sum(1, keepdim=True) - 2 * residual @ embed + sq)
            idx = dist.max(dim=-1).indices
            codes.append(idx)
            residual = residual - book[idx]
        return torch.stack(codes)

    @torch.inference_mode()
    def encode(
        self,
        audio: torch.Tensor,
        chunk_frames: int = 512,
        context_frames: int = 16,
        on_chunk: Callable[[int, int], None] | None = None,
    ) -> torch.Tensor:
        """audio (channels, samples), float in [-1, 1] → codes (n_q, frames), int64."""
        cfg = self.cfg
        samples = int(audio.shape[-1])
        frames = cfg.frames(samples)
        x = audio.to(self.codebooks.device, torch.float32).unsqueeze(0)
        if frames == 0:
            return torch.zeros(cfg.n_codebooks, 0, dtype=torch.long)
        if chunk_frames <= 0 or frames <= chunk_frames:
            z = self.encoder(x)[0, :, :frames].t()  # (frames, dim)
            if on_chunk:
                on_chunk(1, 1)
            return self.quantize(z).cpu()
        pieces, hop = [], cfg.hop
        n = math.ceil(frames / chunk_frames)
        for k in range(n):
            a, b = k * chunk_frames, min(frames, (k + 1) * chunk_frames)
            lo, hi = max(0, a - context_frames), min(frames, b + context_frames)
            end = samples if hi == frames else hi * hop  # the last piece ends where the audio does
            z = self.encoder(x[..., lo * hop : end])[0, :, a - lo : b - lo].t()
            pieces.append(self.quantize(z).cpu())
            if on_chunk:
                on_chunk(k + 1, n)
        return torch.cat(pieces, dim=1)


def load_encoder(
    config_path: Path, checkpoint_path: Path, device: torch.device, *, trust_pickle: bool = False
) -> AudioEncoder:
    """The encoder of a decoder's files, strictly (``checkpoints/encoder_load.py``), in float32."""
    t0 = time.perf_counter()
    cfg = read_encoder_config(config_path)
    with torch.device("meta"):
        enc = AudioEncoder(cfg)
    targets = {k: v.shape for k, v in enc.state_dict(keep_vars=True).items()}
    tensors = encoder_tensors(targets, cfg.n_codebooks, checkpoint_path, config_path, trust_pickle=trust_pickle)
    materialise(enc, device, torch.float32)
    own = enc.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, t in tensors.items():
            own[name].data.copy_(t)
    del tensors
    enc = enc.to(device).eval()
    log.info(
        "encoder loaded from %s in %.2f s: strides %s, %d codebooks, %.1f M parameters",
        checkpoint_path,
        time.perf_counter() - t0,
        list(cfg.strides),
        cfg.n_codebooks,
        sum(p.numel() for p in enc.parameters()) / 1e6,
    )
    return enc
