"""The DAC-style codec decoder: RVQ dequantisation, then the DAC decoder network.

Written in the project because the ``descript-audio-codec`` package cannot be imported beside
torch 2.13 (shared/docs/audio-cpu.md). The YAML schemas live in ``checkpoints/decoder_config.py``,
the checkpoint layouts (the release's Lightning file, the tiny set's, DAC's own) and safe,
low-memory reading in ``checkpoints/decoder_load.py``. Weight norm is folded into plain weights at
load. Long codes decode in chunks with context on each side, which gives the one-pass output
(≥ 12 frames of context) with bounded memory.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from songserve.errors import ConfigError
from songserve.pipeline.checkpoints.decoder_config import DecoderConfig, read_decoder_config
from songserve.pipeline.checkpoints.decoder_load import (
    fill,
    plan_sources,
    prepare_destination,
    read_checkpoint,
    tensors_of,
)

__all__ = [
    "AudioDecoder",
    "DecoderConfig",
    "decode_chunks",
    "fold_weight_norm",
    "load_decoder",
    "samples_touched",
    "weight_norm_state",
]

log = logging.getLogger(__name__)


# ---- network (DAC's module tree, so checkpoint keys line up) ------------------------------------


class Snake1d(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + (self.alpha + 1e-9).reciprocal() * torch.sin(self.alpha * x).pow(2)


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int) -> None:
        super().__init__()
        pad = 3 * dilation
        self.block = nn.Sequential(
            Snake1d(dim), nn.Conv1d(dim, dim, 7, dilation=dilation, padding=pad), Snake1d(dim), nn.Conv1d(dim, dim, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        trim = (x.shape[-1] - y.shape[-1]) // 2
        return (x[..., trim:-trim] if trim > 0 else x) + y


class DecoderBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, stride: int) -> None:
        super().__init__()
        self.block = nn.Sequential(
            Snake1d(in_dim),
            nn.ConvTranspose1d(in_dim, out_dim, 2 * stride, stride=stride, padding=math.ceil(stride / 2)),
            ResidualUnit(out_dim, 1),
            ResidualUnit(out_dim, 3),
            ResidualUnit(out_dim, 9),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class Decoder(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        width = cfg.n_filters * 2 ** len(cfg.rates)
        layers: list[nn.Module] = [nn.Conv1d(cfg.latent_dim, width, 7, padding=3)]
        for i, stride in enumerate(cfg.rates):
            layers.append(DecoderBlock(width // 2**i, width // 2 ** (i + 1), stride))
        out_dim = width // 2 ** len(cfg.rates)
        layers += [Snake1d(out_dim), nn.Conv1d(out_dim, cfg.channels, 7, padding=3)]
        if cfg.final_tanh:
            layers.append(nn.Tanh())
        self.model = nn.Sequential(*layers)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.model(z)


class Codebook(nn.Module):
    def __init__(self, size: int, dim: int, latent_dim: int, factorised: bool) -> None:
        super().__init__()
        # Built empty, then initialised as nn.Embedding would be, except on the meta device, where
        # normal_ has no kernel and would pull in torch's decomposition machinery (~4 s of imports).
        self.codebook = nn.Embedding(size, dim, _weight=torch.empty(size, dim))
        if self.codebook.weight.device.type != "meta":
            nn.init.normal_(self.codebook.weight)
        self.out_proj: nn.Conv1d | None = nn.Conv1d(dim, latent_dim, 1) if factorised else None


class Quantizer(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        factorised = cfg.codebook_dim is not None
        dim = cfg.codebook_dim or cfg.latent_dim
        self.quantizers = nn.ModuleList(
            Codebook(cfg.codebook_size, dim, cfg.latent_dim, factorised) for _ in range(cfg.n_codebooks)
        )

    def dequantize(self, codes: torch.Tensor) -> torch.Tensor:
        """codes (B, n_q, frames) → latent (B, latent_dim, frames): the sum of selected entries."""
        z = None
        for i in range(codes.shape[1]):
            q: Codebook = self.quantizers[i]  # type: ignore[assignment]
            e = q.codebook(codes[:, i]).transpose(1, 2)  # (B, dim, frames)
            if q.out_proj is not None:
                e = q.out_proj(e)
            z = e if z is None else z + e
        assert z is not None
        return z


class AudioDecoder(nn.Module):
    """RVQ + decoder; ``decode`` turns (B, n_q, frames) codes into (B, channels, frames · hop)."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.quantizer = Quantizer(cfg)
        self.decoder = Decoder(cfg)

    @torch.inference_mode()
    def decode(
        self,
        codes: torch.Tensor,
        chunk_frames: int = 256,
        context_frames: int = 16,
        on_chunk: Callable[[int, int], None] | None = None,
    ) -> torch.Tensor:
        """Decode in chunks of ``chunk_frames`` with ``context_frames`` on each side."""
        frames = codes.shape[-1]
        if chunk_frames <= 0 or frames <= chunk_frames:
            out = self.decoder(self.quantizer.dequantize(codes))
            if on_chunk:
                on_chunk(1, 1)
            return out
        pieces = []
        spans = decode_chunks(frames, chunk_frames, context_frames)
        n = len(spans)
        for k, span in enumerate(spans):
            pieces.append(self.decode_chunk(codes, span))
            if on_chunk:
                on_chunk(k + 1, n)
        return torch.cat(pieces, dim=-1)

    @torch.inference_mode()
    def decode_chunk(self, codes: torch.Tensor, span: tuple[int, int, int, int]) -> torch.Tensor:
        """One of ``decode``'s chunks ``(a, b, lo, hi)`` (``decode_chunks``): the samples of frames
        ``[a, b)``, decoded from frames ``[lo, hi)``, exactly as ``decode`` computes them."""
        a, b, lo, hi = span
        hop = self.cfg.hop
        wave = self.decoder(self.quantizer.dequantize(codes[..., lo:hi]))
        return wave[..., (a - lo) * hop : (b - lo) * hop]


def decode_chunks(frames: int, chunk_frames: int, context_frames: int) -> list[tuple[int, int, int, int]]:
    """``decode``'s chunks of a grid of ``frames`` frames: per chunk its frames [a, b) and the frames
    [lo, hi) it decodes to make them (the context on each side). One chunk when the grid fits one."""
    if chunk_frames <= 0 or frames <= chunk_frames:
        return [(0, frames, 0, frames)]
    out = []
    for k in range(math.ceil(frames / chunk_frames)):
        a, b = k * chunk_frames, min(frames, (k + 1) * chunk_frames)
        out.append((a, b, max(0, a - context_frames), min(frames, b + context_frames)))
    return out


REACH_FRAMES = 12  # how far a frame's codes reach into the decoded audio, frames each side (exact chunking needs it)


def samples_touched(
    frames: int, chunk_frames: int, context_frames: int, hop: int, start: int, stop: int
) -> tuple[int, int]:
    """The samples ``[first, last)`` of ``decode``'s output that frames ``[start, stop)`` can change, the
    narrower of two bounds that each hold alone: the chunks whose decoded frames (context included)
    hold one of them (elsewhere the decoder ran on the same input), and ``REACH_FRAMES`` each side of
    them (the decoder's receptive field: within one chunk, a sample further away is computed from the
    same codes by the same kernels; on the CPU, bit for bit). ``(0, 0)`` when the span is empty."""
    hit = [(a, b) for a, b, lo, hi in decode_chunks(frames, chunk_frames, context_frames) if lo < stop and hi > start]
    if start >= stop or not hit:
        return 0, 0
    first = max(hit[0][0], start - REACH_FRAMES, 0)
    last = min(hit[-1][1], stop + REACH_FRAMES, frames)
    return first * hop, last * hop


# ---- weight norm helpers (tests and the tiny-set builder) ------------------------------------------

_WN_OLD = re.compile(r"^(.*)\.weight_([gv])$")
_WN_NEW = re.compile(r"^(.*)\.parametrizations\.weight\.original([01])$")


def fold_weight_norm(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Replace (g, v) pairs by the plain weight g · v / ‖v‖ (norm over all dims but the first)."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        m = _WN_OLD.match(key) or _WN_NEW.match(key)
        if m:
            part = {"g": "g", "v": "v", "0": "g", "1": "v"}[m.group(2)]
            pairs.setdefault(m.group(1), {})[part] = value
        else:
            out[key] = value
    for base, p in pairs.items():
        if set(p) != {"g", "v"}:
            raise ConfigError(f"Decoder weight {base} has half of a weight-norm pair.")
        v = p["v"].float()
        norm = v.flatten(1).norm(dim=1).view(-1, *([1] * (v.dim() - 1)))
        out[f"{base}.weight"] = (p["g"].float() * v / norm).to(p["v"].dtype)
    return out


def weight_norm_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse, for writing checkpoints as the reference does: conv weights as (g, v)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key.startswith("decoder.") and key.endswith(".weight") and value.dim() == 3:
            base = key[: -len(".weight")]
            out[f"{base}.weight_g"] = value.flatten(1).norm(dim=1).view(-1, 1, 1)
            out[f"{base}.weight_v"] = value
        else:
            out[key] = value
    return out


# ---- loading ------------------------------------------------------------------------------------


def materialise(module: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Give a meta-built module uninitialised storage (``to_empty`` goes through torch's reference
    ops for meta tensors, which imports sympy: ~1.5 s)."""
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is not None:
                m._parameters[name] = nn.Parameter(
                    torch.empty(p.shape, device=device, dtype=dtype), requires_grad=False
                )
        for name, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[name] = torch.empty(b.shape, device=device, dtype=b.dtype)


def load_decoder(
    config_path: Path,
    checkpoint_path: Path,
    device: torch.device,
    *,
    trust_pickle: bool = False,
    dtype: torch.dtype = torch.float32,
) -> AudioDecoder:
    """Load a decoder strictly: YAML (either schema) + checkpoint (any layout in ``checkpoints/decoder_load.py``).

    Built on the meta device and materialised empty, so no weight is randomly initialised and then
    overwritten; ``trust_pickle`` (the worker's ``TRUST_CHECKPOINT_PICKLE``) allows full unpickling.
    """
    t0 = time.perf_counter()
    raw, mapped = read_checkpoint(checkpoint_path, trust_pickle=trust_pickle)
    if isinstance(raw, dict) and "metadata" in raw and "state_dict" in raw:  # DAC's own format
        meta = raw["metadata"] if isinstance(raw["metadata"], dict) else {}
        cfg = DecoderConfig.from_dac_kwargs(meta.get("kwargs", {}))
    else:
        cfg = read_decoder_config(config_path)
    state = tensors_of(raw, checkpoint_path)
    with torch.device("meta"):
        decoder = AudioDecoder(cfg)
    targets = dict(decoder.state_dict(keep_vars=True))
    sources = plan_sources({k: v.shape for k, v in targets.items()}, state, checkpoint_path, config_path, mapped=mapped)
    materialise(decoder, device, dtype)
    own = decoder.state_dict(keep_vars=True)
    for name, src in sources.items():
        prepare_destination(own[name].data)
        fill(own[name].data, src, mapped=mapped)
    del raw, state, sources
    decoder = decoder.to(device).eval()
    log.info(
        "decoder loaded from %s (%s) in %.2f s: %d codebooks, hop %d, %.1f M parameters",
        checkpoint_path,
        config_path.name,
        time.perf_counter() - t0,
        cfg.n_codebooks,
        cfg.hop,
        sum(p.numel() for p in decoder.parameters()) / 1e6,
    )
    return decoder
