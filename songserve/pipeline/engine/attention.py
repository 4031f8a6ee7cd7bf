"""Megatron's local core attention, computed by torch's fused ``scaled_dot_product_attention``.

The local layer spec's ``DotProductAttention`` materialises the scores with ``baddbmm`` into a
global buffer and runs a separate masked softmax; on the CPU that costs more than the matmuls at
long positions (bench P4, P5). This subclass keeps megatron's module (same constructor, no
parameters, so checkpoints are unchanged) and swaps the arithmetic for one fused call. Masks keep
megatron's convention: boolean, True = masked out.

It runs only inside megatron's own forward, which is the tests' oracle (``oracle.py``) and bench
P4's subject; serving's transformer computes its attention itself (``transformer.py``).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention


class SdpaDotProductAttention(DotProductAttention):
    def forward(  # the contract of DotProductAttention.forward
        self,
        query: torch.Tensor,  # (sq, b, heads, head_dim)
        key: torch.Tensor,  # (sk, b, groups, head_dim)
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,  # (b or 1, 1, sq, sk), True = masked
        attn_mask_type: object = None,
        attention_bias: object = None,
        packed_seq_params: object = None,
    ) -> torch.Tensor:
        assert packed_seq_params is None
        assert attention_bias is None
        sq, b = query.shape[0], query.shape[1]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # (b, heads|groups, s, head_dim)
        repeat = q.shape[1] // k.shape[1]
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        mask = None if attention_mask is None else ~attention_mask
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)  # (sq, b, heads · head_dim)
