"""A megatron-core ``GPTModel`` as both acoustic models use it.

What differs from a text GPT (shared/docs/model.md):
- the input at a position is a row of codebook columns, ``[B, S, C]`` with ``-1`` as padding, and
  its embedding is the sum of the columns' embeddings (``C = 1`` for the backbone);
- the caller projects hidden states onto a slice of the output matrix (one codebook's 1,024 rows),
  never the whole vocabulary, so the model runs with its output layer switched off.

Architecture: ``GPTArch``, from Megatron-LM's saved args (``checkpoints/megatron_args.py``) or from an
optional ``model_config.json``; checkpoint I/O lives in ``checkpoints/gpt_load.py``. Models are built on
the meta device when they are about to be loaded, so no weight is randomly initialised and then
overwritten (that cost more than reading the file at real sizes).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from songserve.errors import ConfigError
from songserve.pipeline.engine.transformer import step_linear

if TYPE_CHECKING:
    from megatron.core.inference.contexts import StaticInferenceContext

log = logging.getLogger(__name__)

MODEL_CONFIG = "model_config.json"
TRACKER = "latest_checkpointed_iteration.txt"


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


class ZeroCenteredNorm(torch.nn.Module):
    """LayerNorm / RMSNorm storing ``gamma − 1`` (Megatron-LM's ``--apply-layernorm-1p``).

    megatron-core implements zero-centred gamma only in its Transformer-Engine and apex norms; the
    local spec's torch norms refuse it. Parameter names match theirs, so checkpoints are unchanged.
    """

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.rms = config.normalization == "RMSNorm"
        self.eps = eps
        self.shape = (hidden_size,)
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        self.bias = None if self.rms else torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight + 1
        if self.rms:
            return torch.nn.functional.rms_norm(x, self.shape, w, self.eps)
        return torch.nn.functional.layer_norm(x, self.shape, w, self.bias, self.eps)


def _activation(name: str) -> Any:
    if name == "squared_relu":
        from megatron.core.activations import squared_relu

        return squared_relu
    return {"gelu": torch.nn.functional.gelu, "silu": torch.nn.functional.silu}[name]


def transformer_config(arch: GPTArch, dtype: torch.dtype, init: bool = True) -> Any:
    """Every math-changing field of ``arch`` on megatron-core's ``TransformerConfig``."""
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.kv_channels,
        ffn_hidden_size=arch.ffn_hidden_size,
        normalization=arch.normalization,
        layernorm_epsilon=arch.norm_epsilon,
        layernorm_zero_centered_gamma=arch.layernorm_zero_centered_gamma,
        qk_layernorm=arch.qk_layernorm,
        gated_linear_unit=arch.gated_linear_unit,
        activation_func=_activation(arch.activation_name),
        bias_activation_fusion=False,
        add_bias_linear=arch.add_bias_linear,
        add_qkv_bias=arch.add_qkv_bias,
        rotary_interleaved=arch.rotary_interleaved,
        apply_rope_fusion=False,
        use_cpu_initialization=True,
        perform_initialization=init,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        cuda_graph_scope=[],
    )


def build_model(arch: GPTArch, device: torch.device, dtype: torch.dtype, init: bool = True) -> Any:
    """Build the GPTModel (local layer spec: no transformer-engine or apex) in eval mode.

    ``init=False`` builds on the meta device and only allocates (``to_empty``): for a model whose
    weights are loaded next, random initialisation would be wasted work.
    """
    import contextlib

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from songserve.pipeline.engine.attention import SdpaDotProductAttention

    config = transformer_config(arch, dtype, init)
    spec = get_gpt_layer_local_spec(normalization=arch.normalization, qk_layernorm=arch.qk_layernorm)
    attn = spec.submodules.self_attention.submodules
    attn.core_attention = SdpaDotProductAttention
    final_norm = None
    if arch.layernorm_zero_centered_gamma:
        spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = ZeroCenteredNorm
        if arch.qk_layernorm:
            attn.q_layernorm = attn.k_layernorm = ZeroCenteredNorm
        final_norm = ZeroCenteredNorm
    layers: Any = spec
    if final_norm is not None:
        layers = TransformerBlockSubmodules(layer_specs=[spec] * arch.num_layers, layer_norm=final_norm)
    with torch.device("meta") if not init else contextlib.nullcontext():
        model = GPTModel(
            config=config,
            transformer_layer_spec=layers,
            vocab_size=arch.rows,
            max_sequence_length=arch.max_sequence_length,
            position_embedding_type=arch.position_embedding_type,
            rotary_percent=arch.rotary_percent,
            rotary_base=arch.rotary_base,
            rope_scaling=arch.rope_scaling,
            rope_scaling_factor=arch.rope_scaling_factor,
            seq_len_interpolation_factor=arch.rotary_interpolation_factor,
            share_embeddings_and_output_weights=arch.share_embeddings_and_output_weights,
        )
    # Every parameter in ``dtype``: megatron-core builds its local torch norms and the learned
    # position table in fp32 whatever ``params_dtype`` says. Megatron-LM serves bf16 through
    # Float16Module, which casts the whole module; without the cast a bf16 model fed fp32 norms
    # into bf16 linears (megatron's own forward refused it; the decode step ran an fp32 residual).
    if not init:
        return model.to_empty(device=device).to(dtype).eval()
    return model.to(device=device, dtype=dtype).eval()


class AcousticGPT:
    """A loaded GPTModel driven with summed-column embeddings and sliced output projections."""

    def __init__(self, arch: GPTArch, model: Any) -> None:
        self.arch = arch
        self.load_sec = 0.0  # set by the loader: reported in /health and the track metadata
        self.model: Any = model  # megatron's GPTModel: submodules are dynamic attributes
        # Hidden states out: _postprocess returns before the output layer when post_process is
        # off; the final layer norm stays (it belongs to the decoder block).
        model.post_process = False
        if arch.share_embeddings_and_output_weights:
            self.output_weight = model.shared_embedding_or_output_weight()
        else:
            self.output_weight = model.output_layer.weight  # (V, H)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype

    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """ids (B, S, C), -1 = padding; positions (B, S) → decoder input (S, B, H)."""
        emb = self.model.embedding
        table = emb.word_embeddings.weight
        if ids.shape[2] == 1 and bool((ids >= 0).all()):  # the backbone's case: one column, no padding
            x = torch.nn.functional.embedding(ids[:, :, 0], table)
        else:
            x = torch.zeros(*ids.shape[:2], table.shape[1], dtype=table.dtype, device=table.device)
            for c in range(ids.shape[2]):  # column by column: bounded memory for 64 columns
                col = ids[:, :, c]
                present = (col >= 0).unsqueeze(-1).to(table.dtype)
                x += torch.nn.functional.embedding(col.clamp(min=0), table) * present
        if getattr(emb, "add_position_embedding", False):
            x = x + emb.position_embeddings(positions)
        return x.transpose(0, 1).contiguous()

    def hidden(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        attention_mask: torch.Tensor | None,
        context: StaticInferenceContext | None = None,
    ) -> torch.Tensor:
        """Run the transformer; returns hidden states (S, B, H) after the final layer norm."""
        out = self.model(
            input_ids=None,
            position_ids=positions,
            attention_mask=attention_mask,
            decoder_input=self.embed(ids, positions),
            inference_context=context,
            runtime_gather_output=True,
        )
        return out

    def project(self, hidden: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Logits over output rows [start, stop) only: (..., H) → (..., stop - start).

        A decode step's few rows go through ``step_linear`` (on the CPU, 1–4 rows times a large window
        as ``w @ x.T``)."""
        return step_linear(hidden, self.output_weight[start:stop])

    def new_kv_context(self, max_len: int, batch: int = 1) -> StaticInferenceContext:
        """A static KV cache with its buffers allocated here, on the model's device (5.)."""
        from megatron.core.inference.contexts import StaticInferenceContext

        ctx = StaticInferenceContext(batch, max_len)
        for layer in self.model.decoder.layers:
            att = layer.self_attention
            shape = (max_len, batch, att.num_query_groups_per_partition, att.key_hidden_size)
            ctx.key_value_memory_dict[att.layer_number] = (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape[:-1] + (att.val_hidden_size,), dtype=self.dtype, device=self.device),
            )
        return ctx


def causal_mask(n: int, device: torch.device) -> torch.Tensor:
    """Explicit prefill mask, True = masked (megatron would build its default on CUDA: 3.)."""
    return torch.ones(n, n, dtype=torch.bool, device=device).triu(1).view(1, 1, n, n)


def full_mask(n: int, device: torch.device) -> torch.Tensor:
    """Non-causal: every position sees every position (the grids carry no padding rows)."""
    return torch.zeros(1, 1, n, n, dtype=torch.bool, device=device)


# ---- checkpoints (checkpoints/gpt_load.py; kept importable from here) --------------------------------------


def load_model(
    path: Path, device: torch.device, dtype: torch.dtype, megatron_args: str = "", kind: str | None = None
) -> AcousticGPT:
    from songserve.pipeline.checkpoints.gpt_load import load_model as _load

    return _load(path, device, dtype, megatron_args, kind)


def save_checkpoint(path: Path, arch: GPTArch, model: Any, iteration: int = 1) -> None:
    from songserve.pipeline.checkpoints.gpt_load import save_checkpoint as _save

    _save(path, arch, model, iteration)
