"""A megatron-core ``GPTModel`` as both acoustic models use it: built from a ``GPTArch``, wrapped.

What differs from a text GPT (docs/model.md):
- the input at a position is a row of codebook columns, ``[B, S, C]`` with ``-1`` as padding, and
  its embedding is the sum of the columns' embeddings (``C = 1`` for the backbone);
- the caller projects hidden states onto a slice of the output matrix (one codebook's 1,024 rows),
  never the whole vocabulary, so the model runs with its output layer switched off.

What serving runs of this module: ``build_model`` at load and ``AcousticGPT.project`` at every
sampled position. It never runs the GPTModel's own forward: the serving transformer is
``transformer.DecodeModel`` over the same parameter tensors, and megatron's forward is the tests'
oracle (``oracle.py``). Architecture: ``arch.py``; checkpoint loading: ``checkpoints/gpt_load.py``.
Models are built on the meta device when they are about to be loaded, so no weight is randomly
initialised and then overwritten (that cost more than reading the file at real sizes).
"""

from __future__ import annotations

from typing import Any

import torch

from songserve.pipeline.engine.arch import GPTArch
from songserve.pipeline.engine.transformer import step_linear


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
    """A loaded GPTModel as the stages hold it: its architecture, weights and sliced output projection."""

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

    def project(self, hidden: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Logits over output rows [start, stop) only: (..., H) → (..., stop - start).

        A decode step's few rows go through ``step_linear`` (on the CPU, 1–4 rows times a large window
        as ``w @ x.T``)."""
        return step_linear(hidden, self.output_weight[start:stop])
