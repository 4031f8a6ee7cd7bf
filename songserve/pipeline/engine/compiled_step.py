"""The decode step under ``torch.compile``: what serving runs on the CPU when ``COMPILE=1``.

``COMPILE`` is the worker setting: ``1`` on, ``0`` off, ``auto`` on for CUDA only, where serving
captures CUDA graphs by hand instead (``graphed_step.py``). The compiled function is
``transformer.DecodeModel.step`` itself, so compiled and eager steps compute the same thing; a
shape that fails to compile falls back to the eager step for good.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from songserve.pipeline.engine.transformer import DecodeModel

log = logging.getLogger(__name__)


def want_compile(setting: str, device: torch.device) -> bool:
    """``COMPILE``: ``1`` on, ``0`` off, ``auto`` on for CUDA only (on the CPU it does not pay)."""
    return setting == "1" or (setting == "auto" and device.type == "cuda")


class CompiledStep:
    """``DecodeModel.step`` under ``torch.compile(fullgraph=True)``; CUDA graphs on CUDA.

    One graph per (batch, KV length bucket): shapes are static inside each. Any failure to
    compile or capture turns this object into the eager step for good, with one log line.
    """

    def __init__(self, dm: DecodeModel, *, backend: str | Callable[..., Any] = "inductor") -> None:
        import torch._dynamo

        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        self.dm = dm
        self.cuda_graphs = dm.device.type == "cuda"
        mode = "reduce-overhead" if self.cuda_graphs else None
        self._fn = torch.compile(dm.step, fullgraph=True, dynamic=False, backend=backend, mode=mode)
        self.graphs: set[tuple[int, int]] = set()  # (batch, kv_len) compiled (and captured on CUDA)
        self.failed: str | None = None

    def __call__(
        self,
        tokens: torch.Tensor,
        pos: torch.Tensor,
        k: list[torch.Tensor],
        v: list[torch.Tensor],
        kv_len: int,
        masked: bool,
    ) -> torch.Tensor:
        if self.failed is not None:
            return self.dm.step(tokens, pos, k, v, kv_len, masked)
        key = (int(tokens.shape[0]), kv_len)
        try:
            if self.cuda_graphs:
                torch.compiler.cudagraph_mark_step_begin()
            out = self._fn(tokens, pos, k, v, kv_len, masked)
        except Exception as exc:
            self.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            log.warning("compiled decode step failed for batch %d, kv %d; eager from now on (%s)", *key, self.failed)
            return self.dm.step(tokens, pos, k, v, kv_len, masked)
        self.graphs.add(key)
        return out

    def warm(self, batches: list[int], kv_lens: list[int], cache_len: int | None = None) -> None:
        """Compile (and capture) the given shapes now, at load, on a scratch cache of ``cache_len``
        positions: the length the backbone decodes into (its context), and under inference mode as
        the backbone decodes: either one differing, the graphs are not reused."""
        with torch.inference_mode():
            self._warm(batches, kv_lens, max(cache_len or 0, *kv_lens))

    def _warm(self, batches: list[int], kv_lens: list[int], length: int) -> None:
        for b in batches:
            cache = self.dm.new_cache(b, length)
            self.dm.rope_tables(length)
            tokens = torch.zeros(b, dtype=torch.long, device=self.dm.device)
            pos = torch.zeros(1, dtype=torch.long, device=self.dm.device)
            for n in kv_lens:
                for _ in range(3 if self.cuda_graphs else 1):  # cudagraph trees record on the 2nd-3rd call
                    self(tokens, pos, cache.k, cache.v, n, True)
                if self.failed:
                    return

    def describe(self) -> dict[str, Any]:
        return {
            "compiled": self.failed is None,
            "cuda_graphs": self.cuda_graphs and self.failed is None,
            "graphs": sorted(f"{b}x{n}" for b, n in self.graphs),
            "fallback": self.failed,
        }
