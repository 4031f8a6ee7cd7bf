"""The DAC-style codec decoder: RVQ dequantisation, then the DAC decoder network.

Written in the project because the ``descript-audio-codec`` package cannot be imported beside
torch 2.13 (shared/docs/audio-cpu.md). Loads two weight layouts with strict key checks:
- reference: YAML config (``encoder``/``decoder``/``quantizer`` sections) + a checkpoint whose
  decoder and quantizer weights sit under ``generator.``;
- DAC: ``{"state_dict": …, "metadata": {"kwargs": …}}`` as DAC saves it.
Weight norm (old ``weight_g``/``weight_v`` or new ``parametrizations.weight.original0/1``) is folded
into plain weights at load. Long codes decode in chunks with context on each side, which gives the
one-pass output (≥ 12 frames of context) with bounded memory.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from songserve.errors import ConfigError


@dataclass(frozen=True)
class CodecConfig:
    sample_rate: int = 44100
    latent_dim: int = 128
    n_filters: int = 192  # decoder's first conv has n_filters · 2^len(rates) channels
    rates: tuple[int, ...] = (8, 8, 8, 4)
    channels: int = 2
    n_codebooks: int = 64
    codebook_size: int = 1024
    codebook_dim: int | None = None  # DAC's factorised codebooks (with out_proj); None = latent_dim
    final_tanh: bool = False

    @property
    def hop(self) -> int:
        return math.prod(self.rates)

    @property
    def frame_rate(self) -> float:
        return self.sample_rate / self.hop

    def to_yaml_dict(self) -> dict:
        return {
            "sample_rate": self.sample_rate,
            "encoder": {"n_filters": self.n_filters // 2, "latent_dim": self.latent_dim},
            "decoder": {
                "n_filters": self.n_filters,
                "upsampling_ratios": list(self.rates),
                "output_channels": self.channels,
                "final_tanh": self.final_tanh,
            },
            "quantizer": {
                "n_codebooks": self.n_codebooks,
                "codebook_size": self.codebook_size,
                "latent_dim": self.latent_dim,
            },
        }

    @classmethod
    def from_yaml_dict(cls, raw: dict, source: str) -> CodecConfig:
        try:
            dec, q = raw["decoder"], raw["quantizer"]
            return cls(
                sample_rate=int(raw.get("sample_rate", 44100)),
                latent_dim=int(q["latent_dim"]),
                n_filters=int(dec["n_filters"]),
                rates=tuple(int(r) for r in dec["upsampling_ratios"]),
                channels=int(dec.get("output_channels", 2)),
                n_codebooks=int(q["n_codebooks"]),
                codebook_size=int(q["codebook_size"]),
                codebook_dim=int(q["codebook_dim"]) if q.get("codebook_dim") else None,
                final_tanh=bool(dec.get("final_tanh", False)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"Decoder config {source} is missing or has a bad field: {exc}.") from None

    @classmethod
    def from_dac_kwargs(cls, kw: dict) -> CodecConfig:
        rates = tuple(kw.get("decoder_rates", (8, 8, 4, 2)))
        return cls(
            sample_rate=int(kw.get("sample_rate", 44100)),
            latent_dim=int(
                kw.get("latent_dim") or kw.get("encoder_dim", 64) * 2 ** len(kw.get("encoder_rates", (2, 4, 8, 8)))
            ),
            n_filters=int(kw.get("decoder_dim", 1536)) // 2 ** len(rates),
            rates=rates,
            channels=1,
            n_codebooks=int(kw.get("n_codebooks", 9)),
            codebook_size=int(kw.get("codebook_size", 1024)),
            codebook_dim=int(kw.get("codebook_dim", 8)),
            final_tanh=True,
        )


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
    def __init__(self, cfg: CodecConfig) -> None:
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
        self.codebook = nn.Embedding(size, dim)
        self.out_proj: nn.Conv1d | None = nn.Conv1d(dim, latent_dim, 1) if factorised else None


class Quantizer(nn.Module):
    def __init__(self, cfg: CodecConfig) -> None:
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


class Codec(nn.Module):
    """RVQ + decoder; ``decode`` turns (B, n_q, frames) codes into (B, channels, frames · hop)."""

    def __init__(self, cfg: CodecConfig) -> None:
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
        frames, hop = codes.shape[-1], self.cfg.hop
        if chunk_frames <= 0 or frames <= chunk_frames:
            out = self.decoder(self.quantizer.dequantize(codes))
            if on_chunk:
                on_chunk(1, 1)
            return out
        pieces = []
        n = math.ceil(frames / chunk_frames)
        for k in range(n):
            a, b = k * chunk_frames, min(frames, (k + 1) * chunk_frames)
            lo, hi = max(0, a - context_frames), min(frames, b + context_frames)
            wave = self.decoder(self.quantizer.dequantize(codes[..., lo:hi]))
            pieces.append(wave[..., (a - lo) * hop : (b - lo) * hop])
            if on_chunk:
                on_chunk(k + 1, n)
        return torch.cat(pieces, dim=-1)


# ---- loading ------------------------------------------------------------------------------------

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


def _decoder_keys(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Keep decoder and quantizer weights (the encoder is not needed to decode)."""
    out = {}
    for key, value in state.items():
        if not key.startswith(prefix):
            continue
        key = key[len(prefix) :]
        if key.startswith("encoder.") or key.endswith((".in_proj.weight_g", ".in_proj.weight_v", ".in_proj.bias")):
            continue
        if key.startswith(("decoder.", "quantizer.")):
            out[key] = value
    return out


def load_codec(config_path: Path, checkpoint_path: Path, device: torch.device) -> Codec:
    """Load a reference-format (YAML + ``generator.``) or DAC-format decoder, strictly."""
    import yaml

    if not checkpoint_path.is_file():
        raise ConfigError(f"Decoder checkpoint {checkpoint_path} does not exist.")
    try:
        raw = torch.load(checkpoint_path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ConfigError(f"Decoder checkpoint {checkpoint_path} could not be read: {exc}") from exc
    if isinstance(raw, dict) and "metadata" in raw and "state_dict" in raw:  # DAC's own format
        cfg = CodecConfig.from_dac_kwargs(raw["metadata"].get("kwargs", {}))
        state = _decoder_keys(raw["state_dict"], "")
    else:
        if not config_path.is_file():
            raise ConfigError(f"Decoder config {config_path} does not exist.")
        try:
            cfg_raw = yaml.safe_load(config_path.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"Decoder config {config_path} is not valid YAML: {exc}") from None
        if not isinstance(cfg_raw, dict):
            raise ConfigError(f"Decoder config {config_path} is not a mapping.")
        cfg = CodecConfig.from_yaml_dict(cfg_raw, str(config_path))
        sd: dict = raw.get("state_dict", raw) if isinstance(raw, dict) else {}
        sd = sd["generator"] if isinstance(sd.get("generator"), dict) else sd
        state = _decoder_keys(sd, "generator.") or _decoder_keys(sd, "")
    codec = Codec(cfg)
    try:
        codec.load_state_dict(fold_weight_norm(state), strict=True)
    except RuntimeError as exc:
        first = str(exc).splitlines()[1].strip() if "\n" in str(exc) else str(exc)
        raise ConfigError(f"Decoder checkpoint {checkpoint_path} does not match {config_path}: {first}") from None
    return codec.to(device).eval()
