"""The serving transformer: plain functions over megatron's ``GPTModel`` weights. What serving runs.

Prefill chunks, super-resolution passes and the backbone's one-token step all run here
(``DecodeModel``); megatron's own forward is only the tests' oracle (``oracle.py``).

Why not megatron's forward per token: it reads the KV cache length from Python state, builds masks
and rotary tables per call and repeats K/V for grouped-query attention, so every token costs host
work and the loop cannot be captured. Here the per-token step is one function with static shapes
(batch, KV length bucket) over the same parameter tensors (no copy): the write position is a
device tensor, attention is ``scaled_dot_product_attention(enable_gqa=True)`` with no mask when the
visible keys are exactly the cache prefix, and every architecture choice (norm and its epsilon,
zero-centred gamma, biases, gated MLP and its activation, GQA, RoPE or learned positions, softmax
scale) is read from the model's own ``TransformerConfig`` and rotary module, so any GPTModel the
checkpoint loader builds runs here unchanged. The step runs as it is (eager), compiled
or captured in CUDA graphs (``decode_step.py``'s modes; ``fused_step.py`` is the same step over
Triton kernels); its per-token form is written for fusion (q and k rotated in one pass, K/V written
straight from the qkv layout: tests/model/test_decode_modes.py counts inductor's kernels); the cache it writes is
``kv_cache.py``'s.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from songserve.pipeline.engine.kv_cache import KVCache
from songserve.pipeline.engine.lora import LoRASlots, Picked, RowLoRA, add_delta

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
        self.lora: LoRASlots | None = None  # adapter slots (``lora.py``), made with the first adapter
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

    def lora_dims(self) -> dict[str, tuple[int, int]]:
        """Each adapter target's (in, out) features: what an adapter's A and B must fit."""
        lw = self.layers[0]
        return {
            "linear_qkv": (lw.qkv_w.shape[1], lw.qkv_w.shape[0]),
            "linear_proj": (lw.proj_w.shape[1], lw.proj_w.shape[0]),
            "linear_fc1": (lw.fc1_w.shape[1], lw.fc1_w.shape[0]),
            "linear_fc2": (lw.fc2_w.shape[1], lw.fc2_w.shape[0]),
        }

    def lora_slots(self, slots: int, rank: int) -> LoRASlots:
        """The model's adapter slots, made once (their tensors never move: a compiled or captured
        step keeps reading them)."""
        if self.lora is None or self.lora.slots != slots or self.lora.rank != rank:
            self.lora = LoRASlots(self.lora_dims(), len(self.layers), slots, rank, self.device, self.dtype)
        return self.lora

    def pick_lora(self, lora: RowLoRA | None) -> Picked | None:
        """Each row's adapter weights for this forward or step (None: the base model)."""
        return None if lora is None or self.lora is None else self.lora.pick(lora)

    @staticmethod
    def _delta(out: torch.Tensor, name: str, i: int, x: torch.Tensor, lora: Picked | None) -> torch.Tensor:
        """``out`` plus each row's adapter delta for target ``name`` of layer ``i`` (none: ``out`` itself)."""
        if lora is None:
            return out
        return add_delta(out, lora, name, i, x)

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
        self, lw: LayerWeights, x: torch.Tensor, linear: Linear = F.linear, lora: Picked | None = None, i: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, S, H) → q (B, heads, S, D), k and v (B, groups, S, D), in megatron's interleaved layout."""
        s = self.spec
        B, S = x.shape[:2]
        xn = _norm(x, lw.ln1_w, lw.ln1_b, s).to(self.dtype)
        mixed = self._delta(linear(xn, lw.qkv_w, lw.qkv_b), "linear_qkv", i, xn, lora)
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

    def _rope_sign(self) -> torch.Tensor:
        """+1/−1 per rotary channel: ``_rotate_half``'s negated half, as a factor of sin."""
        rot = self._rope_cos.shape[-1] if self._rope_cos is not None else 0
        neg = (
            torch.arange(rot, device=self.device) % 2 == 0
            if self.spec.rotary_interleaved
            else torch.arange(rot, device=self.device) < rot // 2
        )
        return 1.0 - 2.0 * neg.to(self.dtype)

    def _rope_fused(self, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``_rope`` with the partner channel read in place (a roll, or a swap of pairs) instead of a
        concatenation, and ``sin`` already signed: bitwise the same values (``x·(−s) = −(x·s)``), one
        pointwise pass that the compiler fuses."""
        rot = cos.shape[-1]
        t1 = t[..., :rot]
        if self.spec.rotary_interleaved:
            partner = t1.unflatten(-1, (rot // 2, 2)).flip(-1).flatten(-2)
        else:
            partner = t1.roll(rot // 2, -1)
        r = t1 * cos + partner * sin
        return torch.cat((r, t[..., rot:]), dim=-1) if rot < t.shape[-1] else r

    def _finish_layer(
        self,
        lw: LayerWeights,
        x: torch.Tensor,
        attn: torch.Tensor,
        linear: Linear = F.linear,
        lora: Picked | None = None,
        i: int = 0,
    ) -> torch.Tensor:
        """attn (B, S, heads·D) → output projection, residual, MLP, residual."""
        s = self.spec
        out = linear(attn, lw.proj_w)
        if lw.proj_b is not None:
            out = out + lw.proj_b
        out = self._delta(out, "linear_proj", i, attn, lora)
        x = x + out.to(x.dtype)
        xn = _norm(x, lw.ln2_w, lw.ln2_b, s).to(self.dtype)
        h = self._delta(linear(xn, lw.fc1_w, lw.fc1_b), "linear_fc1", i, xn, lora)
        if s.gated:
            a, b = h.chunk(2, dim=-1)
            h = self.activation(a) * b
        else:
            h = self.activation(h)
        out = linear(h, lw.fc2_w)
        if lw.fc2_b is not None:
            out = out + lw.fc2_b
        out = self._delta(out, "linear_fc2", i, h, lora)
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
        lora: RowLoRA | None = None,  # each row's adapter (``lora.py``); None: the base model
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
        picked = self.pick_lora(lora)
        for i, lw in enumerate(self.layers):
            q, k, v = self._qkv(lw, x, lora=picked, i=i)
            if cos is not None and sin is not None:
                q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            if cache is not None:
                cache.k[i][:, :, start:end] = k
                cache.v[i][:, :, start:end] = v
                k, v = cache.k[i][:, :, :end], cache.v[i][:, :, :end]
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal and mask is None, scale=self.spec.scale, enable_gqa=True
            )
            x = self._finish_layer(lw, x, o.transpose(1, 2).reshape(x.shape[0], S, -1), lora=picked, i=i)
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
        lora: RowLoRA | None = None,  # each row's adapter slot and factor; None: the base step
        picked: Picked | None = None,  # ``lora``'s halves picked already (the eager loop: once a batch)
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
            sin = self._rope_sin.index_select(0, pos) * self._rope_sign()  # rotate-half's minus folded in
        mask = None
        if masked:
            mask = (torch.arange(kv_len, device=tokens.device) <= pos).view(1, 1, 1, kv_len)
        per, D = s.heads // s.groups, s.head_dim
        if picked is None:
            picked = self.pick_lora(lora)
        for i, lw in enumerate(self.layers):
            xn = _norm(x, lw.ln1_w, lw.ln1_b, s).to(self.dtype)
            mixed = self._delta(linear(xn, lw.qkv_w, lw.qkv_b), "linear_qkv", i, xn, picked)
            mixed = mixed.view(B, s.groups, per + 2, D)  # megatron's layout: per group, its q heads, k, v
            qk = mixed[:, :, : per + 1]
            if cos is not None and sin is not None:  # q and k of every group rotated in one pass
                qk = self._rope_fused(qk, cos, sin)
            q = qk[:, :, :per].reshape(B, s.heads, 1, D)
            k_cache[i].index_copy_(2, pos, qk[:, :, per : per + 1])
            v_cache[i].index_copy_(2, pos, mixed[:, :, per + 1 :])
            o = F.scaled_dot_product_attention(
                q, k_cache[i][:, :, :kv_len], v_cache[i][:, :, :kv_len], attn_mask=mask, scale=s.scale, enable_gqa=True
            )
            x = self._finish_layer(lw, x, o.reshape(B, 1, -1), linear, picked, i)
        return self.final(x)[:, 0]
