"""Low-rank adapters in the serving transformer: fixed slots of stacked A/B and each row's delta.

A LoRA adapter adds ``scale·(alpha/r)·(x Aᵀ) Bᵀ`` to a linear layer's output ``x Wᵀ + b``, with
``A`` (r × in) and ``B`` (out × r). Several rows of one batch may read different adapters: the base
matmul runs once for every row, and each row's delta is gathered by its slot index — ``A[slot]``,
``Bᵀ[slot]`` picked per row and applied as two batched matmuls (Punica's SGMV done with ``bmm``).
The picking gathers every layer's halves at once, the row's factor folded into its ``A`` (``pick``:
one gather per target and half), so each adapted layer adds two batched products, the add fused
into the second (``baddbmm``). A small layer (``in × out`` at most ``DENSE_MAX_ELEMENTS``) is picked
as one dense ``coef·Aᵀ Bᵀ`` per row instead, one product a step: at such sizes a step is made of
operator calls more than of arithmetic, and the dense product does more arithmetic in one call
fewer (the tiny models' layers; every layer of a released model is factored). The compiled
and captured steps pick inside the step (the slot and factor are its inputs); the eager loop picks
once per batch and hands the picked halves to every step (``DecodeModel.step``'s ``picked``).

Why fixed slots: the stacked tensors are allocated once per model, ``slots + 1`` deep and
``rank`` wide (the largest rank an adapter may have; a smaller adapter is zero-padded, which adds
exact zeros), and installing an adapter copies into them in place. So the step's shapes never
change and a compiled step or a captured CUDA graph stays valid when the slots change. A batch
reads only the first ``RowLoRA.rank`` columns (its largest adapter's rank rounded up to a power of
two, at least 8): a handful of static shapes, so a rank-8 adapter does not pay for 64. Slot 0 is
always zero: a row with no adapter in a mixed batch reads it with a factor of 0 and gets exactly
its base output. A batch with no adapter at all passes no ``RowLoRA`` and runs the base step
unchanged (bitwise the base model).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # megatron's names, the adapters' files'


class RowLoRA(NamedTuple):
    """Each row's slot and its factor ``scale·alpha/r`` (0 and slot 0 for a row with no adapter), and
    how many of the slots' columns the batch reads (static: a compiled step or a graph per value)."""

    slot: torch.Tensor  # (B,) long, on the device
    coef: torch.Tensor  # (B,) the model's dtype, on the device
    rank: int = 0  # 0: every column

    def select(self, rows: torch.Tensor) -> RowLoRA:
        """The rows ``rows`` of this batch (a batch that dropped its finished rows)."""
        return RowLoRA(self.slot.index_select(0, rows), self.coef.index_select(0, rows), self.rank)


# target → per layer, each row's slot's (coef·Aᵀ (B, in, r), Bᵀ (B, r, out)), views of one gather, or
# (coef·Aᵀ Bᵀ (B, in, out), None) for a layer small enough to be dense
Picked = dict[str, list[tuple[torch.Tensor, torch.Tensor | None]]]
MIN_RANK = 8
DENSE_MAX_ELEMENTS = 1 << 16  # in × out up to which a row's delta is one dense matrix (256 KB in fp32)


def rank_bucket(rank: int) -> int:
    """The columns a batch whose largest adapter has ``rank`` reads: a power of two, at least 8."""
    n = MIN_RANK
    while n < rank:
        n *= 2
    return n


def row_lora(
    slots: list[int], coefs: list[float], device: torch.device, dtype: torch.dtype, ranks: list[int] | None = None
) -> RowLoRA | None:
    """The batch's ``RowLoRA``, or None when no row reads an adapter (the base step, unchanged).
    ``ranks``: each row's adapter's rank (None: read every column)."""
    on = [bool(s and c) for s, c in zip(slots, coefs, strict=True)]
    if not any(on):
        return None
    slot = torch.tensor([s if o else 0 for s, o in zip(slots, on, strict=True)], dtype=torch.long, device=device)
    coef = torch.tensor([c if o else 0.0 for c, o in zip(coefs, on, strict=True)], dtype=dtype).to(device)
    rank = rank_bucket(max(r for r, o in zip(ranks, on, strict=True) if o)) if ranks is not None else 0
    return RowLoRA(slot, coef, rank)


class LoRASlots:
    """One model's adapter slots: per target module, ``A`` (slots+1, layers, rank, in) and ``Bᵀ``
    (slots+1, layers, rank, out): slot-major and rank before features, so that a row's gather of
    its first r ranks reads contiguous rows; ``held[s]`` names what slot ``s`` holds now (``None``:
    zeros)."""

    def __init__(
        self,
        dims: dict[str, tuple[int, int]],  # target → (in, out) features
        layers: int,
        slots: int,
        rank: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.slots, self.rank, self.layers = slots, rank, layers
        self.dims = dict(dims)
        self.A: dict[str, torch.Tensor] = {}
        self.Bt: dict[str, torch.Tensor] = {}
        for name, (n_in, n_out) in self.dims.items():
            self.A[name] = torch.zeros(slots + 1, layers, rank, n_in, device=device, dtype=dtype)
            self.Bt[name] = torch.zeros(slots + 1, layers, rank, n_out, device=device, dtype=dtype)
        self.held: list[str | None] = [None] * (slots + 1)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.A.values(), *self.Bt.values()))

    def install(self, slot: int, key: str, weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy one adapter's (A, B) per (layer, target) into ``slot``, in place; what it does not
        target stays zero."""
        if not 1 <= slot <= self.slots:
            raise ValueError(f"slot {slot} is not one of 1..{self.slots}")
        self.clear(slot)
        for (layer, name), (a, b) in weights.items():
            r = int(a.shape[0])
            if r > self.rank:
                raise ValueError(f"rank {r} exceeds the slots' rank {self.rank}")
            self.A[name][slot, layer, :r].copy_(a)
            self.Bt[name][slot, layer, :r].copy_(b.t())
        self.held[slot] = key

    def clear(self, slot: int) -> None:
        for t in (*self.A.values(), *self.Bt.values()):
            t[slot].zero_()
        self.held[slot] = None

    def pick(self, rows: RowLoRA) -> Picked:
        """Every layer's ``coef·Aᵀ`` and ``Bᵀ`` of each row's slot, its first ``rows.rank`` ranks."""
        r = min(rows.rank or self.rank, self.rank)
        coef = rows.coef.view(-1, 1, 1, 1)
        out: Picked = {}
        for name in self.A:
            a = self.A[name][:, :, :r].index_select(0, rows.slot) * coef  # (B, L, r, in)
            b = self.Bt[name][:, :, :r].index_select(0, rows.slot)  # (B, L, r, out)
            n_in, n_out = self.dims[name]
            if n_in * n_out <= DENSE_MAX_ELEMENTS:
                dense = torch.matmul(a.transpose(2, 3), b)  # (B, L, in, out)
                out[name] = [(dense[:, i], None) for i in range(self.layers)]
            else:
                out[name] = [(a[:, i].transpose(1, 2), b[:, i]) for i in range(self.layers)]
        return out


def add_delta(out: torch.Tensor, picked: Picked, name: str, layer: int, x: torch.Tensor) -> torch.Tensor:
    """``out`` (B, S, out) plus each row's delta for ``x`` (B, S, in): the add fused into the second product."""
    at, b = picked[name][layer]
    if out.dtype != at.dtype:
        return out + delta(picked, name, layer, x).to(out.dtype)
    return torch.baddbmm(out, x, at) if b is None else torch.baddbmm(out, torch.bmm(x, at), b)


def delta(picked: Picked, name: str, layer: int, x: torch.Tensor) -> torch.Tensor:
    """x (B, S, in) → each row's ``coef·(x Aᵀ) Bᵀ`` (B, S, out), its slot's, for target ``name`` of ``layer``."""
    at, b = picked[name][layer]
    return torch.bmm(x, at) if b is None else torch.bmm(torch.bmm(x, at), b)
