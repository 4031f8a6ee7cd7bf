"""The decode step's static KV cache: fixed (batch, length) buffers, one K and one V tensor per layer.

Layout: one ``(batch, groups, length, head_dim)`` tensor per layer for K and for V, the layout SDPA
reads without a transpose; prefill writes a prefix, the step writes one column in place. Separate
tensors (not one stacked buffer) matter under ``torch.compile``: an in-place write into a graph
input is kept in place, where a write into a view of one big input is functionalised into a copy
of the whole cache on every token. What serving decodes into (``transformer.DecodeModel.new_cache``,
or ``decode_step.DecodeStep``'s persistent cache under CUDA graphs).
"""

from __future__ import annotations

import torch


class KVCache:
    """A static cache: fixed (batch, length) buffers; rows can be copied, dropped or moved."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        self.k, self.v = k, v  # per layer (B, G, L, D)

    @property
    def batch(self) -> int:
        return int(self.k[0].shape[0])

    @property
    def length(self) -> int:
        return int(self.k[0].shape[2])

    def rows(self, a: int, b: int) -> KVCache:
        """A view of rows [a, b) (prefill writes row 0 only)."""
        return KVCache([t[a:b] for t in self.k], [t[a:b] for t in self.v])

    def broadcast_row0(self, upto: int) -> None:
        """Copy row 0's first ``upto`` positions (a shared prefill) into every other row."""
        if self.batch > 1:
            for t in (*self.k, *self.v):
                t[1:, :, :upto] = t[:1, :, :upto]

    def copy_row(self, src: int, dst: list[int], upto: int) -> None:
        """Copy row ``src``'s first ``upto`` positions (one group's prefill) into rows ``dst``."""
        if not dst:
            return
        if src == 0 and dst == list(range(1, self.batch)):
            self.broadcast_row0(upto)
            return
        for r in dst:
            for t in (*self.k, *self.v):
                t[r : r + 1, :, :upto] = t[src : src + 1, :, :upto]

    def keep_rows(self, rows: list[int]) -> KVCache:
        """A smaller cache holding only ``rows`` (finished rows stop costing)."""
        idx = torch.tensor(rows, device=self.k[0].device)
        return KVCache([t.index_select(0, idx) for t in self.k], [t.index_select(0, idx) for t in self.v])
