"""Split-KV decode attention (flash-decoding) over the static KV cache, as a Triton kernel pair.

Why: one query per row against up to 25,600 cached keys. One program per (row, query group) would
leave most of a GPU idle at batch 1 (8 groups) and walk the keys serially; here the keys are cut
into ``splits`` chunks, each program reduces its chunk for every head of its group (the group's
K/V are read once, grouped-query attention without repeating them) into a partial softmax (max,
sum, weighted values), and a second kernel combines the chunks. The visible keys are
``[0, pos]``, read from the device (no host sync); the chunking depends only on the KV length
bucket, so a captured graph serves every position of its bucket (chunks past ``pos`` exit at once).

``kernels.py`` says where the kernels run without CUDA (Triton's interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from songserve.pipeline.engine.kernels import _pow2


@triton.jit
def _partial(
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    G,
    PER,
    D,
    KV_LEN,
    CHUNK,
    SPLITS,
    sk_b,
    sk_g,
    sk_l,
    sv_b,
    sv_g,
    sv_l,
    scale,
    BP: tl.constexpr,
    BD: tl.constexpr,
    BN: tl.constexpr,
):
    bg = tl.program_id(0)
    split = tl.program_id(1)
    b = bg // G
    g = bg % G
    h = tl.arange(0, BP)
    d = tl.arange(0, BD)
    hm, dm = h < PER, d < D
    q = tl.load(q_ptr + (bg * PER + h[:, None]) * D + d[None, :], mask=hm[:, None] & dm[None, :], other=0.0)
    q = q.to(tl.float32)
    end = tl.minimum(KV_LEN, tl.load(pos_ptr) + 1)  # keys [0, pos] are visible
    lo = split * CHUNK
    hi = tl.minimum(lo + CHUNK, end)
    m_i = tl.full((BP,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BP,), dtype=tl.float32)
    acc = tl.zeros((BP, BD), dtype=tl.float32)
    kb = k_ptr + b * sk_b + g * sk_g
    vb = v_ptr + b * sv_b + g * sv_g
    for n0 in range(lo, hi, BN):
        n = n0 + tl.arange(0, BN)
        nm = n < hi
        k = tl.load(kb + n[:, None] * sk_l + d[None, :], mask=nm[:, None] & dm[None, :], other=0.0).to(tl.float32)
        v = tl.load(vb + n[:, None] * sv_l + d[None, :], mask=nm[:, None] & dm[None, :], other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # (BP, BN)
        s = tl.where(nm[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    base = bg * SPLITS + split
    tl.store(m_ptr + base * BP + h, m_i)
    tl.store(l_ptr + base * BP + h, l_i)
    tl.store(acc_ptr + (base * BP + h[:, None]) * BD + d[None, :], acc)


@triton.jit
def _combine(m_ptr, l_ptr, acc_ptr, o_ptr, PER, D, SPLITS, BP: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr):
    bg = tl.program_id(0)
    s = tl.arange(0, BS)
    h = tl.arange(0, BP)
    d = tl.arange(0, BD)
    sm = s < SPLITS
    idx = (bg * SPLITS + s[:, None]) * BP + h[None, :]  # (BS, BP)
    m = tl.load(m_ptr + idx, mask=sm[:, None], other=float("-inf"))
    lsum = tl.load(l_ptr + idx, mask=sm[:, None], other=0.0)
    best = tl.max(m, axis=0)  # (BP,): split 0 always holds key 0, so finite
    w = tl.where(sm[:, None], tl.exp(m - best[None, :]), 0.0)  # an empty chunk (m = -inf) weighs 0
    total = tl.sum(w * lsum, axis=0)
    acc = tl.load(acc_ptr + idx[:, :, None] * BD + d[None, None, :], mask=sm[:, None, None], other=0.0)
    out = tl.sum(w[:, :, None] * acc, axis=0) / total[:, None]  # (BP, BD)
    om = (h[:, None] < PER) & (d[None, :] < D)
    tl.store(o_ptr + (bg * PER + h[:, None]) * D + d[None, :], out.to(o_ptr.dtype.element_ty), mask=om)


def splits_for(kv_len: int, block: int = 64, most: int = 32) -> tuple[int, int]:
    """(splits, chunk) for a KV length bucket: chunks of at least 128 keys, at most ``most`` of them,
    each a whole number of ``block``-key tiles."""
    splits = max(1, min(most, kv_len // 128))
    chunk = -(-kv_len // splits)
    chunk = -(-chunk // block) * block
    return -(-kv_len // chunk), chunk


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    kv_len: int,
    scale: float,
    block: int = 64,
) -> torch.Tensor:
    """q (B, heads, D) against cache keys [0, min(kv_len, pos + 1)) → (B, heads·D) in q's dtype."""
    B, heads, D = q.shape
    G = k_cache.shape[1]
    per = heads // G
    splits, chunk = splits_for(kv_len, block)
    bp, bd = _pow2(per), _pow2(D)
    dev = q.device
    m = torch.empty(B * G * splits * bp, dtype=torch.float32, device=dev)
    lsum = torch.empty_like(m)
    acc = torch.empty(B * G * splits * bp * bd, dtype=torch.float32, device=dev)
    out = torch.empty(B, heads * D, dtype=q.dtype, device=dev)
    q = q.contiguous()
    _partial[(B * G, splits)](
        q,
        k_cache,
        v_cache,
        pos,
        m,
        lsum,
        acc,
        G,
        per,
        D,
        kv_len,
        chunk,
        splits,
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        scale,
        BP=bp,
        BD=bd,
        BN=block,
    )
    _combine[(B * G,)](m, lsum, acc, out, per, D, splits, BP=bp, BD=bd, BS=_pow2(splits))
    return out
