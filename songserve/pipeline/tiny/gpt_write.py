"""Writing Megatron-LM GPT checkpoints: the tiny sets' and the tests' (serving only reads them).

Two formats, both read by ``checkpoints/gpt_load.py``:
- the project's own (``save_checkpoint``): torch_dist with megatron-core's stacked layers and local
  names, plus ``model_config.json`` beside the iterations (the default tiny set);
- the published release's (``save_release_checkpoint``): Transformer-Engine names, the architecture
  in Megatron-LM's saved ``args`` (``release_args``) and no side file, as torch_dist with per-layer
  keys and split SwiGLU, or as the legacy ``mp_rank_00/model_optim_rng.pt``.
Writing goes through ``megatron_env.cpu_checkpoint_io``, so it also runs without CUDA.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from songserve.pipeline.checkpoints.gpt_load import LEGACY_FILE, TRACKER, local_to_te
from songserve.pipeline.engine.arch import MODEL_CONFIG, GPTArch

CONTENT_METADATA = {"singleton_local_shards": True}  # what Megatron-LM with torch >= 2.6 writes


def save_checkpoint(path: Path, arch: GPTArch, model: Any, iteration: int = 1) -> None:
    """The project's own format: torch_dist with stacked layers, plus ``model_config.json``."""
    from megatron.core import dist_checkpointing

    from songserve.pipeline.checkpoints.megatron_env import cpu_checkpoint_io

    it_dir = path / f"iter_{iteration:07d}"
    it_dir.mkdir(parents=True, exist_ok=True)
    with cpu_checkpoint_io():
        dist_checkpointing.save({"model": model.sharded_state_dict()}, str(it_dir))
    (path / TRACKER).write_text(str(iteration))
    (path / MODEL_CONFIG).write_text(json.dumps(dataclasses.asdict(arch), indent=2) + "\n")


def release_args(arch: GPTArch, **extra: Any) -> argparse.Namespace:
    """The Megatron-LM ``args`` a training run of ``arch`` saves (the fields the loader reads)."""
    from megatron.core.transformer.enums import AttnBackend

    ns = argparse.Namespace(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        group_query_attention=arch.num_query_groups is not None,
        num_query_groups=arch.num_query_groups or 1,
        kv_channels=arch.kv_channels or arch.hidden_size // arch.num_attention_heads,
        max_position_embeddings=arch.max_sequence_length,
        seq_length=arch.max_sequence_length,
        position_embedding_type=arch.position_embedding_type,
        rotary_base=arch.rotary_base,
        rotary_percent=arch.rotary_percent,
        rotary_interleaved=arch.rotary_interleaved,
        rotary_seq_len_interpolation_factor=arch.rotary_interpolation_factor,
        use_rope_scaling=arch.rope_scaling,
        rope_scaling_factor=arch.rope_scaling_factor,
        normalization=arch.normalization,
        norm_epsilon=arch.norm_epsilon,
        apply_layernorm_1p=arch.layernorm_zero_centered_gamma,
        qk_layernorm=arch.qk_layernorm,
        swiglu=arch.gated_linear_unit and arch.activation_name == "silu",
        squared_relu=arch.activation_name == "squared_relu",
        add_bias_linear=arch.add_bias_linear,
        add_qkv_bias=arch.add_qkv_bias,
        untie_embeddings_and_output_weights=not arch.share_embeddings_and_output_weights,
        vocab_size=arch.vocab_size,
        padded_vocab_size=arch.rows,
        make_vocab_size_divisible_by=128,
        tokenizer_type="NullTokenizer",
        num_experts=None,
        multi_latent_attention=False,
        apply_residual_connection_post_layernorm=False,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        transformer_impl="transformer_engine",
        attention_backend=AttnBackend.auto,
        params_dtype=torch.bfloat16,
        bf16=True,
        ckpt_format="torch_dist",
    )
    for k, v in extra.items():
        setattr(ns, k, v)
    return ns


def save_release_checkpoint(
    path: Path, model: Any, args: argparse.Namespace, iteration: int = 1, legacy: bool = False
) -> None:
    """Write a checkpoint as the published release stores it: TE names, saved args, no side file.

    torch_dist: per-layer keys and split SwiGLU (content metadata ``singleton_local_shards``), args
    in ``common.pt``. ``legacy``: ``mp_rank_00/model_optim_rng.pt`` with TE names and the args.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    from songserve.pipeline.checkpoints.megatron_env import cpu_checkpoint_io

    it_dir = path / f"iter_{iteration:07d}"
    it_dir.mkdir(parents=True, exist_ok=True)
    if legacy:
        state = {local_to_te(k): v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
        (it_dir / LEGACY_FILE).parent.mkdir(parents=True, exist_ok=True)
        torch.save(
            {"args": args, "checkpoint_version": 3.0, "iteration": iteration, "model": state}, it_dir / LEGACY_FILE
        )
    else:
        sharded = {}
        for k, v in model.sharded_state_dict(metadata=CONTENT_METADATA).items():
            if isinstance(v, ShardedObject):
                continue
            if isinstance(v, ShardedTensor | ShardedTensorFactory):
                v.key = local_to_te(v.key)
            sharded[k] = v
        state = {"model": sharded, "args": args, "checkpoint_version": 3.0, "iteration": iteration}
        with cpu_checkpoint_io():
            dist_checkpointing.save(state, str(it_dir), content_metadata=dict(CONTENT_METADATA))
    (path / TRACKER).write_text(str(iteration))
