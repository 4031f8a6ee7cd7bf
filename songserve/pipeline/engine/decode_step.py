"""The backbone's one-token decode step, in one of four modes: what serving runs for every token.

``DECODE_MODE`` picks the mode (``choose_mode``); every mode computes ``DecodeModel.step``'s
hidden state, so every mode draws the eager tokens (bitwise on the CPU, tests/model/test_decode_modes.py):

- ``eager``: ``DecodeModel.step`` as it is;
- ``compiled``: the same function under ``torch.compile(fullgraph=True)``, inductor's fusion and
  no CUDA graphs of its own (no ``reduce-overhead``): on CUDA the capture below is the one;
- ``graphs``: the eager step captured as CUDA graphs by hand;
- ``fused``: the step written over the Triton kernels of ``kernels.py`` (``fused_step.py``), its
  output projection and sampling one kernel too; captured as CUDA graphs on CUDA.

On CUDA every mode but eager captures one graph per (batch, KV length bucket), by hand rather than
through ``mode="reduce-overhead"``: capture takes seconds, and the graph's inputs are explicit. A
graph reads fixed addresses, so every batch decodes into one persistent cache of the full context:
a batch of ``b`` takes uses its first ``b`` rows (``cache_for``; a prefix of the batch dimension is
a contiguous view), so the cache costs ``rows`` takes' KV whatever mix of batch sizes comes, taken
once, at load (``warm``). Token and position are copied into static buffers before each replay
(device-to-device, no host sync). Capturing a new bucket mid-song is safe: the warm-up runs write
exactly what the real step writes (same token, same position, same prefix). ``graphs`` on the CPU
keeps that bookkeeping (persistent cache, static buffers) and calls the step where CUDA would
replay, so the CPU tests cover it. On the CPU ``compiled`` and ``fused`` decode into a cache of the
full context per request instead (static shapes: one compile per batch and bucket).

Any failure to compile, capture or launch turns the step into the eager one for good, with one log
line (``/health`` → ``decode_step``).

A batch with adapters (``lora.py``: each row's slot and factor) runs in every mode: the compiled
step compiles its own graph for it (one per batch, bucket and rank bucket, beside the base one);
``graphs`` (and ``fused`` on CUDA) records one with static slot and factor buffers, replayed like
the base one (the slots' tensors never move); the fused step adds the delta with torch's batched
products between its kernels (``fused_step.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from songserve.pipeline.engine.kv_cache import KVCache
from songserve.pipeline.engine.lora import RowLoRA
from songserve.pipeline.engine.transformer import DecodeModel

log = logging.getLogger(__name__)

MODES = ("eager", "compiled", "graphs", "fused")
StepFn = Callable[..., torch.Tensor]


def choose_mode(decode_mode: str, compile_setting: str, device: torch.device) -> str:
    """``DECODE_MODE`` when set; ``auto`` keeps what ``COMPILE`` chose before modes existed: CUDA
    graphs on CUDA (``COMPILE`` auto or 1), ``compiled`` on the CPU with ``COMPILE=1``, else eager."""
    if decode_mode != "auto":
        return decode_mode
    if device.type == "cuda":
        return "graphs" if compile_setting in ("auto", "1") else "eager"
    return "compiled" if compile_setting == "1" else "eager"


@dataclass
class _Graph:
    replay: Callable[[], None]
    tokens: torch.Tensor
    pos: torch.Tensor
    out: torch.Tensor
    lora: RowLoRA | None = None  # static slot and factor buffers of a graph with adapters


def _reason(exc: BaseException) -> str:
    text = str(exc).splitlines()[0][:200] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"


class DecodeStep:
    """``DecodeModel.step`` in one ``mode`` (module docstring); called as the step itself."""

    def __init__(
        self, dm: DecodeModel, mode: str, max_len: int, *, backend: str | Callable[..., Any] = "inductor"
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"decode mode {mode!r} is not one of {', '.join(MODES)}")
        self.dm, self.mode, self.max_len = dm, mode, max_len
        self.capture = dm.device.type == "cuda" and mode != "eager"
        self.persistent = self.capture or mode == "graphs"  # one cache, the graphs' addresses
        self.failed: str | None = None
        self.sampler: Any = None  # fused: projection + top-k + draw in one kernel (backbone's loop)
        self.rows = 0  # takes the persistent cache holds (allocated on first use, at load by warm)
        self._cache: KVCache | None = None
        self._views: dict[int, KVCache] = {}  # batch size → the first rows of the persistent cache
        self._graphs: dict[tuple[int, int, int], _Graph] = {}  # (batch, KV length, adapters' rank or -1)
        self._ran: set[tuple[int, int, int]] = set()  # (batch, KV length, adapters' rank or -1) run (not persistent)
        self.pool: Any = None  # one memory pool shared by every captured graph
        self.fn: StepFn = dm.step
        try:
            if mode == "compiled":
                self.fn = self._compile(backend)
            elif mode == "fused":
                from songserve.pipeline.engine.fused_step import FusedStep

                fused = FusedStep(dm)
                self.fn, self.sampler = fused, fused.sample
        except Exception as exc:  # triton missing, an architecture the kernels do not cover
            self._fail(exc, "set-up")

    def _compile(self, backend: str | Callable[..., Any]) -> StepFn:
        import torch._dynamo

        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        # inductor's default mode: fusion without CUDA graphs of its own (the capture here is the one)
        options: dict[str, Any] | None = {"triton.cudagraphs": False} if backend == "inductor" else None
        fn: StepFn = torch.compile(self.dm.step, fullgraph=True, dynamic=False, backend=backend, options=options)
        return fn

    def _fail(self, exc: BaseException, what: str) -> None:
        self.failed = _reason(exc)
        self.sampler = None
        log.warning("decode step (%s) failed at %s; eager from now on (%s)", self.mode, what, self.failed)

    @property
    def graphs(self) -> set[tuple[int, int]]:
        """(batch, KV length) shapes compiled or captured."""
        return {(b, n) for b, n, _ in (*self._graphs, *self._ran)}

    def reset(self) -> None:
        """Forget every graph and persistent cache: the weights moved (park mode), and a graph reads
        the addresses it was captured on. The next call of each shape captures it again."""
        self._graphs.clear()
        self._views.clear()
        self._cache = None
        self.pool = None

    def _persistent(self, length: int) -> bool:
        return self.persistent and self.failed is None and length <= self.max_len

    def cache_for(self, batch: int, length: int) -> KVCache:
        """Where a batch decodes: the first ``batch`` rows of the persistent cache (a wider batch
        regrows it, and every graph is captured again), else a new cache of ``length``."""
        if not self._persistent(length):
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
        if not self._persistent(length):
            return batch * self.dm.kv_bytes_per_take(length)
        if batch <= self.rows and self._cache is not None:
            return 0
        return max(batch, self.rows) * self.dm.kv_bytes_per_take(self.max_len)

    def can_shrink(self, rows: int, kv_len: int, rank: int = -1) -> bool:
        """Whether the loop may drop finished rows: never over the persistent cache (the rows would
        have to move to its front); compiled, when the smaller batch is compiled already (with
        adapters of the rank bucket ``rank``, or none: -1)."""
        if self.failed is not None or self.mode == "eager":
            return True
        if self.persistent:
            return False
        return self.mode != "compiled" or (rows, kv_len, rank) in self._ran

    def _record(
        self,
        tokens: torch.Tensor,
        pos: torch.Tensor,
        k: list[torch.Tensor],
        v: list[torch.Tensor],
        kv_len: int,
        lora: RowLoRA | None = None,
    ) -> _Graph:
        st, sp = tokens.clone(), pos.clone()
        sl = None if lora is None else RowLoRA(lora.slot.clone(), lora.coef.clone(), lora.rank)
        if not self.capture:  # graphs on the CPU: the same buffers, the step called where CUDA replays
            out = self.fn(st, sp, k, v, kv_len, True, sl)

            def replay() -> None:
                out.copy_(self.fn(st, sp, k, v, kv_len, True, sl))

            return _Graph(replay, st, sp, out, sl)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # compiles (compiled), autotunes / JITs (fused) outside the capture
                self.fn(st, sp, k, v, kv_len, True, sl)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.fn(st, sp, k, v, kv_len, True, sl)
        self.pool = graph.pool()
        return _Graph(graph.replay, st, sp, out, sl)

    def __call__(
        self,
        tokens: torch.Tensor,
        pos: torch.Tensor,
        k: list[torch.Tensor],
        v: list[torch.Tensor],
        kv_len: int,
        masked: bool,
        lora: RowLoRA | None = None,
    ) -> torch.Tensor:
        if self.failed is not None:
            return self.dm.step(tokens, pos, k, v, kv_len, masked, lora)
        key = (int(tokens.shape[0]), kv_len)
        try:
            if not self.persistent:
                out = (
                    self.fn(tokens, pos, k, v, kv_len, masked)
                    if lora is None
                    else self.fn(tokens, pos, k, v, kv_len, masked, lora)
                )
                self._ran.add((*key, -1 if lora is None else lora.rank))
                return out
            own = self._views.get(key[0])
            if own is None or own.k[0].data_ptr() != k[0].data_ptr():  # a cache not ours: no graph reads it
                return self.dm.step(tokens, pos, k, v, kv_len, masked, lora)
            gkey = (*key, -1 if lora is None else lora.rank)
            g = self._graphs.get(gkey)
            if g is None:
                g = self._graphs[gkey] = self._record(tokens, pos, k, v, kv_len, lora)
            g.tokens.copy_(tokens)
            g.pos.copy_(pos)
            if lora is not None and g.lora is not None:
                g.lora.slot.copy_(lora.slot)
                g.lora.coef.copy_(lora.coef)
            g.replay()
            return g.out
        except Exception as exc:
            self._fail(exc, f"batch {key[0]}, kv {key[1]}")
            return self.dm.step(tokens, pos, k, v, kv_len, masked, lora)

    def warm(self, batches: list[int], kv_lens: list[int], cache_len: int | None = None) -> None:
        """Compile or capture the given shapes now, at load, under inference mode as the backbone
        decodes: over the persistent cache (the widest batch first, so that no later batch size
        regrows it), else over a scratch cache of ``cache_len`` (the length the backbone decodes into)."""
        if self.mode == "eager" or self.failed is not None:
            return
        length = self.max_len if self.persistent else max(cache_len or 0, *kv_lens)
        with torch.inference_mode():
            self.dm.rope_tables(length)
            if self.persistent and batches:
                self.cache_for(max(batches), length)
            for b in batches:
                cache = self.cache_for(b, length)
                tokens = torch.zeros(b, dtype=torch.long, device=self.dm.device)
                pos = torch.zeros(1, dtype=torch.long, device=self.dm.device)
                for n in kv_lens:
                    self(tokens, pos, cache.k, cache.v, min(n, length), True)
                    if self.failed:
                        return

    def describe(self) -> dict[str, Any]:
        ok = self.failed is None
        return {
            "mode": self.mode if ok else "eager",
            "compiled": self.mode == "compiled" and ok,
            "cuda_graphs": self.capture and ok,
            "graphs": sorted(f"{b}x{n}" for b, n in self.graphs),
            "fallback": self.failed,
            "kv_rows": self.rows,  # takes the persistent cache holds (the graphs' batch sizes share it)
            "kv_bytes": self.rows * self.dm.kv_bytes_per_take(self.max_len) if self._cache is not None else 0,
        }
