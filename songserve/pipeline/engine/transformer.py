"""The transformer as plain functions over megatron's ``GPTModel`` weights: a decode step ready for graphs.

Why not megatron's forward per token: it reads the KV cache length from Python state, builds masks
and rotary tables per call and repeats K/V for grouped-query attention, so every token costs host
work and the loop cannot be captured. Here the per-token step is one function with static shapes
(batch, KV length bucket) over the same parameter tensors (no copy): the write position is a
device tensor, attention is ``scaled_dot_product_attention(enable_gqa=True)`` with no mask when the
visible keys are exactly the cache prefix, and every architecture choice (norm and its epsilon,
zero-centred gamma, biases, gated MLP and its activation, GQA, RoPE or learned positions, softmax
scale) is read from the model's own ``TransformerConfig`` and rotary module, so any GPTModel the
checkpoint loader builds runs here unchanged.

Layout: the static KV cache is one ``(batch, groups, length, head_dim)`` tensor per layer for K and
for V, the layout SDPA reads without a transpose; prefill writes a prefix, the step writes one
column in place. Separate tensors (not one stacked buffer) matter under ``torch.compile``: an
in-place write into a graph input is kept in place, where a write into a view of one big input
is functionalised into a copy of the whole cache on every token.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)
Linear = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class StepSpec:
    """The architecture choices the step needs, read once from megatron's config and modules."""

    num_layers: int
    hidden: int
    heads: int
    groups: int
    head_dim: int
    normalization: str  # "LayerNorm" | "RMSNorm"
    eps: float
    zero_centered_gamma: bool  # megatron's "1p" norms: weight + 1
    gated: bool  # SwiGLU / GeGLU: fc1 holds [gate; up]
    scale: float
    rope: bool
    rotary_interleaved: bool
    learned_positions: bool
    fp32_residual: bool


@dataclass
class LayerWeights:
    ln1_w: torch.Tensor
    ln1_b: torch.Tensor | None
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    proj_w: torch.Tensor
    proj_b: torch.Tensor | None
    ln2_w: torch.Tensor
    ln2_b: torch.Tensor | None
    fc1_w: torch.Tensor
    fc1_b: torch.Tensor | None
    fc2_w: torch.Tensor
    fc2_b: torch.Tensor | None


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

    def keep_rows(self, rows: list[int]) -> KVCache:
        """A smaller cache holding only ``rows`` (finished rows stop costing)."""
        idx = torch.tensor(rows, device=self.k[0].device)
        return KVCache([t.index_select(0, idx) for t in self.k], [t.index_select(0, idx) for t in self.v])


def _norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, spec: StepSpec) -> torch.Tensor:
    if spec.zero_centered_gamma:
        w = w + 1
    if spec.normalization == "RMSNorm":
        return F.rms_norm(x, (x.shape[-1],), w, spec.eps)
    return F.layer_norm(x, (x.shape[-1],), w, b, spec.eps)


FEW_ROWS = 4  # 1..FEW_ROWS rows times a large weight: the CPU matmul runs weight-major (``step_linear``)
LARGE_WEIGHT = 1 << 18  # elements (1 MiB fp32): below this the weight sits in cache and plain F.linear is cheaper


def step_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for the decode step; up to 4 rows times a large weight on the CPU go as ``w @ x.T``.

    Why: the step multiplies 1–4 rows (one per take) by each weight matrix, and MKL on these
    CPUs handles that shape badly both ways the plain call can go: one row is a matrix-vector
    product that streams the weights slower than a gemm does, and 2–4 rows as ``x @ w.T`` are a
    gemm that packs its weight operand on every call (2 takes cost ~1.5× one take in the linears
    of a 512-wide model: P9's miss). With the weight as the left operand a gemm streams the
    weights once for all rows; one row is padded with a zero row to take the same kernel. Measured
    over a 512-wide model's 32 matrices, 1 thread (ms): 1 row 6.4 → 5.3, 2 rows 9.8 → 5.4,
    3 rows 11.2 → 7.5, 4 rows 9.3 → 8.1, 6 rows 10.8 vs 11.5 (so at most ``FEW_ROWS``). Small
    weights (the tiny model's) stay in cache, where the plain call is cheaper than the extra
    copies. Shapes are static per call: ``torch.compile`` sees one branch. The same kernel for a
    take alone and in a batch of 2 or 3 also gives a row bitwise the values it gets alone.
    """
    rows = x.numel() // max(x.shape[-1], 1)
    if x.device.type != "cpu" or rows > FEW_ROWS or w.numel() < LARGE_WEIGHT:
        return F.linear(x, w, b)
    flat = x.reshape(rows, x.shape[-1])
    if rows == 1:
        flat = torch.cat([flat, torch.zeros_like(flat)])
    xt = flat.t()
    out = torch.mm(w, xt) if b is None else torch.addmm(b.unsqueeze(1), w, xt)
    # contiguous again (a few rows: cheap), so what follows sees F.linear's layout (SDPA's CPU
    # flash kernel, for one, is chosen only for contiguous inputs)
    return out[:, :rows].t().contiguous().view(*x.shape[:-1], w.shape[0])


def _rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if not interleaved:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


class DecodeModel:
    """Functions over one loaded GPTModel: full forward (prefill, superres) and the one-token step."""

    def __init__(self, model: Any, output_weight: torch.Tensor) -> None:
        cfg = model.config  # megatron's TransformerConfig: the single source of the choices
        if cfg.apply_residual_connection_post_layernorm:
            raise ValueError("post-layernorm residuals are not supported by the decode step")
        if getattr(cfg, "qk_layernorm", False) or getattr(cfg, "multi_latent_attention", False):
            raise ValueError("qk layernorm / MLA are not supported by the decode step")
        kv = cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
        self.spec = StepSpec(
            num_layers=cfg.num_layers,
            hidden=cfg.hidden_size,
            heads=cfg.num_attention_heads,
            groups=cfg.num_query_groups or cfg.num_attention_heads,
            head_dim=kv,
            normalization=cfg.normalization,
            eps=cfg.layernorm_epsilon,
            zero_centered_gamma=bool(cfg.layernorm_zero_centered_gamma),
            gated=bool(cfg.gated_linear_unit),
            scale=cfg.softmax_scale if cfg.softmax_scale is not None else 1.0 / math.sqrt(kv),
            rope=getattr(model, "position_embedding_type", "") == "rope",
            rotary_interleaved=bool(cfg.rotary_interleaved),
            learned_positions=bool(getattr(model.embedding, "add_position_embedding", False)),
            fp32_residual=bool(cfg.fp32_residual_connection),
        )
        self.activation = cfg.activation_func
        self.word = model.embedding.word_embeddings.weight
        self.pos_table = model.embedding.position_embeddings.weight if self.spec.learned_positions else None
        self.layers = [self._layer(layer) for layer in model.decoder.layers]
        self.largest_weight = max(
            (w.numel() for lw in self.layers for w in (lw.qkv_w, lw.proj_w, lw.fc1_w, lw.fc2_w)), default=0
        )
        fn = model.decoder.final_layernorm
        self.final_w, self.final_b = fn.weight, getattr(fn, "bias", None)
        self.output_weight = output_weight
        self.device, self.dtype = self.word.device, self.word.dtype
        self._rope_cos: torch.Tensor | None = None
        self._rope_sin: torch.Tensor | None = None
        self._inv_freq: torch.Tensor | None = None
        self._rope_scale = 1.0
        if self.spec.rope:
            rot = model.rotary_pos_emb
            self._inv_freq = rot.inv_freq.detach().to("cpu", torch.float32)
            factor = getattr(rot, "seq_len_interpolation_factor", None)
            self._rope_scale = 1.0 / factor if factor else 1.0

    @staticmethod
    def _layer(layer: Any) -> LayerWeights:
        att, mlp = layer.self_attention, layer.mlp
        ln1, ln2 = layer.input_layernorm, layer.pre_mlp_layernorm
        return LayerWeights(
            ln1.weight,
            getattr(ln1, "bias", None),
            att.linear_qkv.weight,
            att.linear_qkv.bias,
            att.linear_proj.weight,
            att.linear_proj.bias,
            ln2.weight,
            getattr(ln2, "bias", None),
            mlp.linear_fc1.weight,
            mlp.linear_fc1.bias,
            mlp.linear_fc2.weight,
            mlp.linear_fc2.bias,
        )

    # -- buffers ---------------------------------------------------------------------------------
    def kv_bytes_per_take(self, length: int) -> int:
        s = self.spec
        return 2 * s.num_layers * s.groups * length * s.head_dim * self.word.element_size()

    def new_cache(self, batch: int, length: int) -> KVCache:
        s = self.spec
        shape = (batch, s.groups, length, s.head_dim)

        def one() -> list[torch.Tensor]:
            return [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(s.num_layers)]

        return KVCache(one(), one())

    def rope_tables(self, length: int) -> None:
        """cos/sin for positions [0, length), computed as megatron does (fp32 freqs, cast at use)."""
        if self._inv_freq is None or (self._rope_cos is not None and self._rope_cos.shape[0] >= length):
            return
        seq = torch.arange(length, dtype=torch.float32) * self._rope_scale
        freqs = torch.outer(seq, self._inv_freq)
        if self.spec.rotary_interleaved:
            emb = torch.stack((freqs, freqs), dim=-1).flatten(-2)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        self._rope_cos = emb.cos().to(self.device, self.dtype)
        self._rope_sin = emb.sin().to(self.device, self.dtype)

    # -- pieces ----------------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """ids (B, S) or (B, S, C) with -1 padding (summed columns) → (B, S, H)."""
        if ids.dim() == 2:
            x = F.embedding(ids, self.word)
        else:
            x = torch.zeros(*ids.shape[:2], self.word.shape[1], dtype=self.dtype, device=self.device)
            for c in range(ids.shape[2]):
                col = ids[:, :, c]
                x += F.embedding(col.clamp(min=0), self.word) * (col >= 0).unsqueeze(-1).to(self.dtype)
        if self.pos_table is not None and positions is not None:
            x = x + F.embedding(positions, self.pos_table)
        if self.spec.fp32_residual:
            x = x.float()
        return x

    def _qkv(
        self, lw: LayerWeights, x: torch.Tensor, linear: Linear = F.linear
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, S, H) → q (B, heads, S, D), k and v (B, groups, S, D), in megatron's interleaved layout."""
        s = self.spec
        B, S = x.shape[:2]
        mixed = linear(_norm(x, lw.ln1_w, lw.ln1_b, s).to(self.dtype), lw.qkv_w, lw.qkv_b)
        per = s.heads // s.groups
        mixed = mixed.view(B, S, s.groups, (per + 2) * s.head_dim)
        q, k, v = mixed.split([per * s.head_dim, s.head_dim, s.head_dim], dim=-1)
        q = q.reshape(B, S, s.heads, s.head_dim).transpose(1, 2)
        return q, k.transpose(1, 2), v.transpose(1, 2)

    def _rope(self, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot = cos.shape[-1]
        t1, t2 = t[..., :rot], t[..., rot:]
        t1 = t1 * cos + _rotate_half(t1, self.spec.rotary_interleaved) * sin
        return torch.cat((t1, t2), dim=-1) if t2.shape[-1] else t1

    def _finish_layer(
        self, lw: LayerWeights, x: torch.Tensor, attn: torch.Tensor, linear: Linear = F.linear
    ) -> torch.Tensor:
        """attn (B, S, heads·D) → output projection, residual, MLP, residual."""
        s = self.spec
        out = linear(attn, lw.proj_w)
        if lw.proj_b is not None:
            out = out + lw.proj_b
        x = x + out.to(x.dtype)
        h = linear(_norm(x, lw.ln2_w, lw.ln2_b, s).to(self.dtype), lw.fc1_w, lw.fc1_b)
        if s.gated:
            a, b = h.chunk(2, dim=-1)
            h = self.activation(a) * b
        else:
            h = self.activation(h)
        out = linear(h, lw.fc2_w)
        if lw.fc2_b is not None:
            out = out + lw.fc2_b
        return x + out.to(x.dtype)

    def final(self, x: torch.Tensor) -> torch.Tensor:
        return _norm(x, self.final_w, self.final_b, self.spec).to(self.dtype)

    def project(self, h: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        return h @ self.output_weight[start:stop].t()

    # -- full sequences: prefill chunks and superres passes --------------------------------------
    def forward(
        self,
        x: torch.Tensor,  # (B, S, H) embeddings
        *,
        start: int = 0,
        cache: KVCache | None = None,
        causal: bool = True,
        key_padding: torch.Tensor | None = None,  # (B, S) True = a padding key (non-causal only)
    ) -> torch.Tensor:
        """Hidden states (B, S, H) after the final norm. With a cache, positions [start, start+S)
        are written and attended causally over the cache prefix (chunked prefill)."""
        S = x.shape[1]
        end = start + S
        cos = sin = None
        if self.spec.rope:
            self.rope_tables(end)
            assert self._rope_cos is not None
            assert self._rope_sin is not None
            cos, sin = self._rope_cos[start:end], self._rope_sin[start:end]
        mask = None
        if key_padding is not None:
            mask = (~key_padding)[:, None, None, :]  # SDPA: True = attend
        elif causal and start > 0:  # a later chunk: its rows see the whole prefix plus their own past
            mask = torch.ones(S, end, dtype=torch.bool, device=x.device).tril(start)
        for i, lw in enumerate(self.layers):
            q, k, v = self._qkv(lw, x)
            if cos is not None and sin is not None:
                q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            if cache is not None:
                cache.k[i][:, :, start:end] = k
                cache.v[i][:, :, start:end] = v
                k, v = cache.k[i][:, :, :end], cache.v[i][:, :, :end]
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal and mask is None, scale=self.spec.scale, enable_gqa=True
            )
            x = self._finish_layer(lw, x, o.transpose(1, 2).reshape(x.shape[0], S, -1))
        return self.final(x)

    # -- the one-token step ----------------------------------------------------------------------
    def step(
        self,
        tokens: torch.Tensor,  # (B,) long, on the device
        pos: torch.Tensor,  # (1,) long, on the device: the write position
        k_cache: list[torch.Tensor],
        v_cache: list[torch.Tensor],
        kv_len: int,  # static: keys [0, kv_len) are read
        masked: bool,  # static: False when kv_len == pos + 1 exactly (no mask at all)
    ) -> torch.Tensor:
        """One token per row → hidden (B, H) after the final norm. No host synchronisation: shapes
        depend only on (B, kv_len); the position lives on the device."""
        s = self.spec
        B = tokens.shape[0]
        # a model whose weights all sit in cache (the tiny set) skips step_linear's checks entirely
        weight_major = self.device.type == "cpu" and B <= FEW_ROWS and self.largest_weight >= LARGE_WEIGHT
        linear: Linear = step_linear if weight_major else F.linear
        x = F.embedding(tokens.view(B, 1), self.word)
        if self.pos_table is not None:
            x = x + self.pos_table.index_select(0, pos).view(1, 1, -1)
        if s.fp32_residual:
            x = x.float()
        cos = sin = None
        if self._rope_cos is not None and self._rope_sin is not None:
            cos = self._rope_cos.index_select(0, pos)  # (1, rot)
            sin = self._rope_sin.index_select(0, pos)
        mask = None
        if masked:
            mask = (torch.arange(kv_len, device=tokens.device) <= pos).view(1, 1, 1, kv_len)
        for i, lw in enumerate(self.layers):
            q, k, v = self._qkv(lw, x, linear)  # q (B, heads, 1, D), k/v (B, G, 1, D)
            if cos is not None and sin is not None:
                q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            k_cache[i].index_copy_(2, pos, k)
            v_cache[i].index_copy_(2, pos, v)
            o = F.scaled_dot_product_attention(
                q, k_cache[i][:, :, :kv_len], v_cache[i][:, :, :kv_len], attn_mask=mask, scale=s.scale, enable_gqa=True
            )
            x = self._finish_layer(lw, x, o.reshape(B, 1, -1), linear)
        return self.final(x)[:, 0]


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
