"""Token sampling: temperature, top-k and optional top-p with a seeded generator."""

from __future__ import annotations

import torch


def sample(
    logits: torch.Tensor,
    top_k: int,
    generator: torch.Generator,
    temperature: float = 1.0,
    top_p: float | None = None,
) -> torch.Tensor:
    """logits (N, V) → indices (N,) drawn from the filtered distribution."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / max(temperature, 1e-5)
    k = max(1, min(top_k, logits.shape[-1]))
    vals, idx = torch.topk(logits, k, dim=-1)  # (N, k), sorted descending
    probs = torch.softmax(vals, dim=-1)
    if top_p is not None and top_p < 1.0:
        cum = probs.cumsum(-1)
        probs = probs.masked_fill(cum - probs > top_p, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    choice = torch.multinomial(probs, 1, generator=generator)  # (N, 1)
    return idx.gather(-1, choice).squeeze(-1)
