"""Low-rank adapters in the serving transformer: fixed slots of stacked A/B and each row's delta.

A LoRA adapter adds ``scale·(alpha/r)·(x Aᵀ) Bᵀ`` to a linear layer's output ``x Wᵀ + b``, with
``A`` (r × in) and ``B`` (out × r). Several rows of one batch may read different adapters: the base
matmul runs once for every row, and each row's delta is gathered by its slot index — ``A[slot]``,
``B[slot]`` picked per row and applied as two batched matmuls (Punica's SGMV done with ``bmm``).

Why fixed slots: the stacked tensors are allocated once per model, ``slots + 1`` deep and
``rank`` wide (the largest rank an adapter may have; a smaller adapter is zero-padded, which adds
exact zeros), and installing an adapter copies into them in place. So the step's shapes never
change and a compiled step or a captured CUDA graph stays valid when the slots change. Slot 0 is
always zero: a row with no adapter in a mixed batch reads it with a factor of 0 and gets exactly
its base output. A batch with no adapter at all passes no ``RowLoRA`` and runs the base step
unchanged (bitwise the base model).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # megatron's names, the adapters' files'


class RowLoRA(NamedTuple):
    """Each row's slot and its factor ``scale·alpha/r`` (0 and slot 0 for a row with no adapter)."""

    slot: torch.Tensor  # (B,) long, on the device
    coef: torch.Tensor  # (B,) the model's dtype, on the device

    def select(self, rows: torch.Tensor) -> RowLoRA:
        """The rows ``rows`` of this batch (a batch that dropped its finished rows)."""
        return RowLoRA(self.slot.index_select(0, rows), self.coef.index_select(0, rows))


def row_lora(slots: list[int], coefs: list[float], device: torch.device, dtype: torch.dtype) -> RowLoRA | None:
    """The batch's ``RowLoRA``, or None when no row reads an adapter (the base step, unchanged)."""
    if not any(s and c for s, c in zip(slots, coefs, strict=True)):
        return None
    slot = torch.tensor([s if c else 0 for s, c in zip(slots, coefs, strict=True)], dtype=torch.long, device=device)
    return RowLoRA(
        slot, torch.tensor([c if s else 0.0 for s, c in zip(slots, coefs, strict=True)], dtype=dtype).to(device)
    )


class LoRASlots:
    """One model's adapter slots: per target module and layer, ``A`` (slots+1, rank, in) and
    ``B`` (slots+1, out, rank); ``held[s]`` names what slot ``s`` holds now (``None``: zeros)."""

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
        self.A: dict[str, list[torch.Tensor]] = {}
        self.B: dict[str, list[torch.Tensor]] = {}
        for name, (n_in, n_out) in self.dims.items():
            self.A[name] = [torch.zeros(slots + 1, rank, n_in, device=device, dtype=dtype) for _ in range(layers)]
            self.B[name] = [torch.zeros(slots + 1, n_out, rank, device=device, dtype=dtype) for _ in range(layers)]
        self.held: list[str | None] = [None] * (slots + 1)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in (*self.A.values(), *self.B.values()) for t in ts)

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
            self.A[name][layer][slot, :r].copy_(a)
            self.B[name][layer][slot, :, :r].copy_(b)
        self.held[slot] = key

    def clear(self, slot: int) -> None:
        for ts in (*self.A.values(), *self.B.values()):
            for t in ts:
                t[slot].zero_()
        self.held[slot] = None

    def delta(self, name: str, layer: int, x: torch.Tensor, rows: RowLoRA) -> torch.Tensor:
        """x (B, S, in) → each row's ``coef·(x A[slot]ᵀ) B[slot]ᵀ`` (B, S, out)."""
        a = self.A[name][layer].index_select(0, rows.slot)  # (B, rank, in)
        b = self.B[name][layer].index_select(0, rows.slot)  # (B, out, rank)
        xa = torch.bmm(x, a.transpose(1, 2)) * rows.coef.view(-1, 1, 1)  # (B, S, rank)
        return torch.bmm(xa, b.transpose(1, 2))
