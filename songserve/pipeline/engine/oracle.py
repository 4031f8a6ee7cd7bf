"""Megatron's own forward over an ``AcousticGPT``: the tests' oracle. Serving never runs it.

Serving runs ``transformer.DecodeModel``, plain functions over the same parameter tensors (its
docstring says why not megatron's forward per token). The tests, and bench P4, check it against
what megatron-core itself computes: ``GPTModel.forward`` with the summed-column embedding as its
decoder input, megatron's boolean masks (True = masked) and its static KV-cache context.

Two of megatron-core's CUDA assumptions are met here (shared/docs/megatron-cpu.md; the others are
``checkpoints/megatron_env.py``'s): the prefill mask is explicit, since megatron would build its
default causal mask on CUDA (3.), and the KV-cache buffers are allocated on the model's device (5.).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from songserve.pipeline.engine.gpt import AcousticGPT

if TYPE_CHECKING:
    from megatron.core.inference.contexts import StaticInferenceContext


def _decoder_input(gpt: AcousticGPT, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """ids (B, S, C), -1 = padding; positions (B, S) → decoder input (S, B, H)."""
    emb = gpt.model.embedding
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


def megatron_forward(
    gpt: AcousticGPT,
    ids: torch.Tensor,
    positions: torch.Tensor,
    attention_mask: torch.Tensor | None,
    context: StaticInferenceContext | None = None,
) -> torch.Tensor:
    """Run megatron's transformer; returns hidden states (S, B, H) after the final layer norm."""
    out = gpt.model(
        input_ids=None,
        position_ids=positions,
        attention_mask=attention_mask,
        decoder_input=_decoder_input(gpt, ids, positions),
        inference_context=context,
        runtime_gather_output=True,
    )
    return out


def new_kv_context(gpt: AcousticGPT, max_len: int, batch: int = 1) -> StaticInferenceContext:
    """A static KV cache with its buffers allocated here, on the model's device (5.)."""
    from megatron.core.inference.contexts import StaticInferenceContext

    ctx = StaticInferenceContext(batch, max_len)
    for layer in gpt.model.decoder.layers:
        att = layer.self_attention
        shape = (max_len, batch, att.num_query_groups_per_partition, att.key_hidden_size)
        ctx.key_value_memory_dict[att.layer_number] = (
            torch.zeros(shape, dtype=gpt.dtype, device=gpt.device),
            torch.zeros(shape[:-1] + (att.val_hidden_size,), dtype=gpt.dtype, device=gpt.device),
        )
    return ctx


def causal_mask(n: int, device: torch.device) -> torch.Tensor:
    """Explicit prefill mask, True = masked (megatron would build its default on CUDA: 3.)."""
    return torch.ones(n, n, dtype=torch.bool, device=device).triu(1).view(1, 1, n, n)


def full_mask(n: int, device: torch.device) -> torch.Tensor:
    """Non-causal: every position sees every position (the grids carry no padding rows)."""
    return torch.zeros(1, 1, n, n, dtype=torch.bool, device=device)
