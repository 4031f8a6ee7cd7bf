"""The decode step captured as CUDA graphs by hand: what serving runs on CUDA when ``COMPILE`` is on.

Each graph replays ``transformer.DecodeModel.step`` for one (batch, KV length bucket) over one
persistent cache (``GraphedStep``'s docstring says why by hand and how the cache is shared); any
failure falls back to the eager step for good. Serving builds one on CUDA only (on the CPU:
``compiled_step.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from songserve.pipeline.engine.kv_cache import KVCache
from songserve.pipeline.engine.transformer import DecodeModel

log = logging.getLogger(__name__)


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    tokens: torch.Tensor
    pos: torch.Tensor
    out: torch.Tensor


class GraphedStep:
    """CUDA: the step captured as a CUDA graph per (batch, KV length bucket), by hand.

    Why by hand rather than ``mode="reduce-overhead"``: capture takes seconds instead of an
    inductor compile of every layer, and the graph's inputs are explicit. A graph reads fixed
    addresses, so every batch decodes into one persistent cache of the full context: a batch of
    ``b`` takes uses its first ``b`` rows (``cache_for``; a prefix of the batch dimension is a
    contiguous view), so the cache costs ``rows`` takes' KV whatever mix of batch sizes comes, and
    that memory is taken once, at load (``warm``). The token and position are copied into static
    buffers before each replay (device-to-device, no host sync). Capturing a new bucket mid-song
    is safe: the warm-up runs write exactly what the real step writes (same token, same position,
    same prefix).
    Any failure falls back to the eager step for good, with one log line.
    """

    def __init__(self, dm: DecodeModel, max_len: int) -> None:
        self.dm = dm
        self.max_len = max_len
        self.rows = 0  # takes the persistent cache holds (allocated on first use, at load by warm)
        self._cache: KVCache | None = None
        self._views: dict[int, KVCache] = {}  # batch size → the first rows of the persistent cache
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self.failed: str | None = None
        self.pool: Any = None  # one memory pool shared by every captured graph

    @property
    def graphs(self) -> set[tuple[int, int]]:
        return set(self._graphs)

    def reset(self) -> None:
        """Forget every graph and persistent cache: the weights moved (park mode), and a graph reads
        the addresses it was captured on. The next call of each shape captures it again."""
        self._graphs.clear()
        self._views.clear()
        self._cache = None
        self.pool = None

    def _graphed(self, length: int) -> bool:
        return self.failed is None and length <= self.max_len

    def cache_for(self, batch: int, length: int) -> KVCache:
        """The first ``batch`` rows of the persistent cache (graphs captured on it read its
        addresses). A batch wider than the cache regrows it, and every graph is captured again."""
        if not self._graphed(length):
            return self.dm.new_cache(batch, length)
        if batch > self.rows:
            self.reset()  # the graphs read the old cache's addresses
            self.rows = batch
        if self._cache is None:
            self._cache = self.dm.new_cache(self.rows, self.max_len)
        if batch not in self._views:
            c = self._cache
            self._views[batch] = KVCache([t[:batch] for t in c.k], [t[:batch] for t in c.v])
        return self._views[batch]

    def kv_bytes_new(self, batch: int, length: int) -> int:
        """Device memory a batch would newly take for its KV: none where the persistent cache
        already holds its rows."""
        if not self._graphed(length):
            return batch * self.dm.kv_bytes_per_take(length)
        if batch <= self.rows and self._cache is not None:
            return 0
        return max(batch, self.rows) * self.dm.kv_bytes_per_take(self.max_len)

    def _capture(
        self, tokens: torch.Tensor, pos: torch.Tensor, k: list[torch.Tensor], v: list[torch.Tensor], kv_len: int
    ) -> _Graph:
        st, sp = tokens.clone(), pos.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.dm.step(st, sp, k, v, kv_len, True)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.dm.step(st, sp, k, v, kv_len, True)
        self.pool = graph.pool()
        return _Graph(graph, st, sp, out)

    def __call__(
        self,
        tokens: torch.Tensor,
        pos: torch.Tensor,
        k: list[torch.Tensor],
        v: list[torch.Tensor],
        kv_len: int,
        masked: bool,
    ) -> torch.Tensor:
        batch = int(tokens.shape[0])
        own = self._views.get(batch)
        if self.failed is not None or own is None or own.k[0].data_ptr() != k[0].data_ptr():
            return self.dm.step(tokens, pos, k, v, kv_len, masked)
        key = (batch, kv_len)
        g = self._graphs.get(key)
        try:
            if g is None:
                g = self._graphs[key] = self._capture(tokens, pos, k, v, kv_len)
            g.tokens.copy_(tokens)
            g.pos.copy_(pos)
            g.graph.replay()
        except Exception as exc:
            self.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            log.warning("CUDA graph capture failed for batch %d, kv %d; eager from now on (%s)", *key, self.failed)
            return self.dm.step(tokens, pos, k, v, kv_len, masked)
        return g.out

    def warm(self, batches: list[int], kv_lens: list[int]) -> None:
        """Capture the given shapes now, at load: the cache for the widest batch first, so that no
        later batch size regrows it (which would drop the graphs captured before)."""
        self.dm.rope_tables(self.max_len)
        if batches:
            self.cache_for(max(batches), self.max_len)
        for b in batches:
            cache = self.cache_for(b, self.max_len)
            tokens = torch.zeros(b, dtype=torch.long, device=self.dm.device)
            pos = torch.zeros(1, dtype=torch.long, device=self.dm.device)
            for n in kv_lens:
                self(tokens, pos, cache.k, cache.v, min(n, self.max_len), True)
                if self.failed:
                    return

    def describe(self) -> dict[str, Any]:
        return {
            "compiled": False,
            "cuda_graphs": self.failed is None,
            "graphs": sorted(f"{b}x{n}" for b, n in self._graphs),
            "fallback": self.failed,
            "kv_rows": self.rows,  # takes the persistent cache holds (the graphs' batch sizes share it)
            "kv_bytes": self.rows * self.dm.kv_bytes_per_take(self.max_len) if self._cache is not None else 0,
        }
