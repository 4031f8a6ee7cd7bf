"""``GPTArch``: what decides the network's computation, read from ``model_config.json`` or Megatron flags.

Both acoustic models are megatron-core ``GPTModel``s; this dataclass is everything that decides what
one computes (layers, widths, norms, positions, activation, vocabulary and its padding) plus the
serving limits that go with it (prompt length, KV-cache context). The checkpoint loader fills it
from Megatron-LM's saved args (``checkpoints/megatron_args.py``, ``checkpoints/gpt_load.py``) or
from ``model_config.json``; ``gpt.build_model`` builds the network from it. Serving reads it at
load and for its limits (context, prompt length).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from songserve.errors import ConfigError

MODEL_CONFIG = "model_config.json"


@dataclass(frozen=True)
class GPTArch:
    """Everything that decides what the network computes, plus the serving limits that go with it.

    ``vocab_size`` is the real vocabulary (T + levels·1024); the model's embedding and output rows
    are ``padded_vocab_size`` (Megatron-LM pads to a multiple of 128). The padded rows are loaded
    and never sampled: both stages project onto one codebook window at a time.
    """

    kind: str  # "backbone" or "superres"
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    text_vocab_size: int  # T: audio ids start here
    vocab_size: int  # backbone T + 2·1024, superres T + 64·1024
    max_sequence_length: int
    max_prompt_length: int
    num_query_groups: int | None = None
    normalization: str = "LayerNorm"
    position_embedding_type: str = "learned_absolute"
    gated_linear_unit: bool = False
    share_embeddings_and_output_weights: bool = False
    padded_vocab_size: int | None = None  # None: = vocab_size
    kv_channels: int | None = None  # None: hidden_size / num_attention_heads
    norm_epsilon: float = 1e-5
    layernorm_zero_centered_gamma: bool = False  # Megatron-LM's --apply-layernorm-1p
    qk_layernorm: bool = False
    activation: str | None = None  # gelu | silu | squared_relu; None: silu when gated, else gelu
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    rotary_base: int = 10000
    rotary_percent: float = 1.0
    rotary_interleaved: bool = False
    rotary_interpolation_factor: float | None = None
    rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    inference_max_seq_length: int | None = None  # the launcher's KV-cache context

    @property
    def rows(self) -> int:
        """Rows of the embedding and output matrices as stored (padded)."""
        return self.padded_vocab_size or self.vocab_size

    @property
    def context_length(self) -> int:
        """Positions generation may use: the launcher's ``--inference-max-seq-length`` where the
        positions allow it (RoPE has no table), else the trained ``max_sequence_length``."""
        if self.inference_max_seq_length and self.position_embedding_type == "rope":
            return self.inference_max_seq_length
        return min(self.max_sequence_length, self.inference_max_seq_length or self.max_sequence_length)

    def summary(self) -> dict[str, Any]:
        """``/config``'s ``architectures`` entry: what a person checks against the release."""
        return {
            "layers": self.num_layers,
            "hidden": self.hidden_size,
            "heads": self.num_attention_heads,
            "query_groups": self.num_query_groups or self.num_attention_heads,
            "position_embedding": self.position_embedding_type,
            "normalization": f"{self.normalization} eps={self.norm_epsilon:g}",
            "vocab": self.vocab_size,
            "padded_vocab": self.rows,
            "text_vocab": self.text_vocab_size,
        }

    @property
    def activation_name(self) -> str:
        return self.activation or ("silu" if self.gated_linear_unit else "gelu")

    @classmethod
    def from_json(cls, cfg_file: Path, overrides: dict[str, Any] | None = None) -> GPTArch:
        try:
            raw = json.loads(cfg_file.read_text())
        except FileNotFoundError:
            raise ConfigError(f"Checkpoint {cfg_file.parent} has no {MODEL_CONFIG}.") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{cfg_file} is not valid JSON: {exc}.") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{cfg_file} must hold a JSON object.")
        raw.update(overrides or {})
        return cls.from_fields(raw, str(cfg_file))

    @classmethod
    def from_fields(cls, raw: dict[str, Any], source: str) -> GPTArch:
        names = {f.name for f in dataclasses.fields(cls)}
        if raw.get("num_tokens_to_generate") is not None:  # tiny sets before version 4 wrote it (as null)
            raise ConfigError(
                f"{source}: num_tokens_to_generate is a worker setting, not part of the model: "
                "set MAX_NEW_TOKENS or pass --num-tokens-to-generate instead."
            )
        raw = {k: v for k, v in raw.items() if k != "num_tokens_to_generate"}
        unknown = set(raw) - names
        if unknown:
            raise ConfigError(f"{source} has unknown keys: {', '.join(sorted(unknown))}.")
        try:
            arch = cls(**raw)
        except TypeError as exc:
            raise ConfigError(f"{source} is incomplete: {exc}.") from None
        if arch.activation_name not in _ACTIVATIONS:
            raise ConfigError(f"{source}: activation {arch.activation_name!r} is not one of {', '.join(_ACTIVATIONS)}.")
        return arch

    @classmethod
    def from_dir(cls, path: Path, megatron_args: str = "") -> GPTArch:
        return cls.from_json(path / MODEL_CONFIG, parse_megatron_args(megatron_args))


_ACTIVATIONS = ("gelu", "silu", "squared_relu")


def parse_megatron_args(text: str) -> dict[str, object]:
    """Megatron-LM flags → the ``GPTArch`` fields they override (for ``model_config.json`` sets)."""
    from songserve.pipeline.checkpoints.megatron_args import flags_to_arch_overrides, parse_flags

    return flags_to_arch_overrides(parse_flags(text)) if text.strip() else {}
