"""Token sampling: temperature, top-k and optional top-p with seeded generators, all on the device.

What serving runs for every drawn token, in the backbone and in super-resolution.

``sample`` draws one batch with one generator; ``sample_rows`` filters a batch of rows together and
draws each row with its own generator, so row *i* consumes exactly what ``sample`` would consume
for that row alone. Nothing here converts a tensor to a Python value: no host synchronisation.

The draw is ``torch.multinomial``'s own single-sample algorithm written out (its fast path for one
sample: ``argmax(p / q)`` with ``q ~ Exp(1)`` drawn by ``exponential_`` from the generator, one
value per candidate), so the tokens and the generator's state after the draw are bitwise what
``torch.multinomial(probs, 1, generator=g)`` gives (``test_draw_equals_torch_multinomial``). Why
not call it: on the CPU ``multinomial`` validates its input with reductions on every call (20–50
µs, more than the rest of a tiny model's sampling), and a batch of rows with one generator each
needed one call per row; written out, the per-row part is one ``exponential_`` into that row of a
shared buffer, and the divide and the argmax run once for the whole batch.
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


def _pick(probs: torch.Tensor, q: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """argmax(p / q) per row (multinomial's one-sample rule), mapped back through the top-k indices."""
    choice = torch.div(probs, q, out=q).argmax(-1, keepdim=True)
    return idx.gather(-1, choice).squeeze(-1)


def sample(
    logits: torch.Tensor,
    top_k: int,
    generator: torch.Generator,
    temperature: float = 1.0,
    top_p: float | None = None,
) -> torch.Tensor:
    """logits (N, V) → indices (N,) drawn from the filtered distribution, as ``multinomial(probs, 1)``."""
    probs, idx = _filtered(logits, top_k, temperature, top_p)
    return _pick(probs, torch.empty_like(probs).exponential_(generator=generator), idx)


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
    q = torch.empty_like(probs)
    for row, g in zip(q, generators, strict=True):  # a contiguous row draws what a (1, k) tensor draws
        row.exponential_(generator=g)
    return _pick(probs, q, idx)
