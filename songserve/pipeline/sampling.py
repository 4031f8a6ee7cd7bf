"""Token sampling: temperature, top-k and optional top-p with seeded generators, all on the device.

``sample`` draws one batch with one generator; ``sample_rows`` filters a batch of rows together and
draws each row with its own generator, so row *i* consumes exactly what ``sample`` would consume
for that row alone (the filtering is row-wise, the draw is the same call on the same values).
Nothing here converts a tensor to a Python value: no host synchronisation.
"""

from __future__ import annotations

import torch


def _filtered(logits: torch.Tensor, top_k: int, temperature: float, top_p: float | None) -> tuple:
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
    return probs, idx


def sample(
    logits: torch.Tensor,
    top_k: int,
    generator: torch.Generator,
    temperature: float = 1.0,
    top_p: float | None = None,
) -> torch.Tensor:
    """logits (N, V) → indices (N,) drawn from the filtered distribution."""
    probs, idx = _filtered(logits, top_k, temperature, top_p)
    choice = torch.multinomial(probs, 1, generator=generator)  # (N, 1)
    return idx.gather(-1, choice).squeeze(-1)


def sample_rows(
    logits: torch.Tensor,
    top_k: int,
    generators: list[torch.Generator],
    temperature: float = 1.0,
    top_p: float | None = None,
) -> torch.Tensor:
    """logits (B, V), one generator per row → indices (B,); row i draws as ``sample`` would alone."""
    if len(generators) == 1:
        return sample(logits, top_k, generators[0], temperature, top_p)
    probs, idx = _filtered(logits, top_k, temperature, top_p)
    choice = torch.cat([torch.multinomial(probs[i : i + 1], 1, generator=g) for i, g in enumerate(generators)])
    return idx.gather(-1, choice).squeeze(-1)
