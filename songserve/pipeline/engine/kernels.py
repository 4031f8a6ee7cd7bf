"""Triton kernels for what the compiler leaves unfused in the decode step (``fused_step.py``).

A decode step at batch 1-4 is bound by reading the weights, and on a GPU by the ~15 small kernels
per layer between the weight reads (bench/README.md, "GPU"). These kernels fold the work between
two matrix products into one launch each:

- ``add_rmsnorm``: residual add (with the previous linear's bias) and the next RMSNorm;
- ``swiglu``: the MLP's first matrix (gate and up halves), SiLU and the product, one pass over it;
- ``rope_write``: RoPE on q and k while k and v are written into the static cache at the position;
- ``project_sample``: logits over the current codebook's 1,024 rows (plus the end-of-document row),
  temperature, top-k and the draw, on the device; the per-row generators draw the exponentials
  exactly as ``sampling.sample_rows`` does, so a row consumes the same random numbers.

Split-KV attention is in ``kernels_attention.py``. Every kernel computes in fp32 and rounds where the
eager code rounds. Where there is no CUDA, Triton's interpreter runs them on CPU tensors: set here,
before Triton reads it, so the CPU tests (tests/model/test_kernels.py) check the same kernels against the
eager code. The interpreter has no bf16: the CPU tests run fp32.
"""

from __future__ import annotations

import os
import sys

import torch

# Triton fixes the mode when it is first imported: once imported without the variable (megatron-core
# imports it), the kernels cannot run on CPU tensors in this process (``FusedStep`` refuses).
_LATE = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "") in ("", "0")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402  (after TRITON_INTERPRET: read when the kernels below are decorated)
import triton.language as tl  # noqa: E402

INTERPRETED = not _LATE and os.environ.get("TRITON_INTERPRET", "") not in ("", "0")  # numpy: wide blocks are cheaper


def _pow2(n: int) -> int:
    return int(triton.next_power_of_2(max(int(n), 1)))


@triton.jit
def _add_rmsnorm(
    x_ptr, d_ptr, b_ptr, w_ptr, x_out, y_out, H, eps, HAS_D: tl.constexpr, HAS_B: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    m = offs < H
    x = tl.load(x_ptr + row * H + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_D:
        d = tl.load(d_ptr + row * H + offs, mask=m, other=0.0).to(tl.float32)
        if HAS_B:  # the linear's bias first, as the eager code adds it to the product
            d = (d + tl.load(b_ptr + offs, mask=m, other=0.0).to(tl.float32)).to(d_ptr.dtype.element_ty)
            d = d.to(tl.float32)
        x = (x + d).to(x_out.dtype.element_ty)
        tl.store(x_out + row * H + offs, x, mask=m)
        x = x.to(tl.float32)
    var = tl.sum(x * x, axis=0) / H
    y = x * tl.rsqrt(var + eps) * tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(y_out + row * H + offs, y.to(y_out.dtype.element_ty), mask=m)


def add_rmsnorm(
    x: torch.Tensor, d: torch.Tensor | None, bias: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, H) residual ``x`` plus ``d + bias`` (when given) → (new residual, RMSNorm of it · weight)."""
    x = x.contiguous()
    B, H = x.shape[0], x.shape[-1]
    x_out = torch.empty_like(x) if d is not None else x
    y = torch.empty(x.shape, dtype=weight.dtype, device=x.device)
    dd = d.contiguous() if d is not None else x
    _add_rmsnorm[(B,)](
        x,
        dd,
        bias if bias is not None else x,
        weight,
        x_out,
        y,
        H,
        eps,
        HAS_D=d is not None,
        HAS_B=bias is not None,
        BLOCK=_pow2(H),
    )
    return x_out, y


@triton.jit
def _swiglu(
    y_ptr, w_ptr, b_ptr, out_ptr, M, F, H, HAS_B: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr
):
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    rows = tl.arange(0, BM)
    cm, rm = cols < F, rows < M
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, H, BK):
        kk = k0 + tl.arange(0, BK)
        km = kk < H
        y = tl.load(y_ptr + rows[:, None] * H + kk[None, :], mask=rm[:, None] & km[None, :], other=0.0)
        wmask = cm[:, None] & km[None, :]
        wg = tl.load(w_ptr + cols[:, None] * H + kk[None, :], mask=wmask, other=0.0)
        wu = tl.load(w_ptr + (cols[:, None] + F) * H + kk[None, :], mask=wmask, other=0.0)
        y3 = y.to(tl.float32)[:, None, :]
        acc_g += tl.sum(y3 * wg.to(tl.float32)[None, :, :], axis=2)
        acc_u += tl.sum(y3 * wu.to(tl.float32)[None, :, :], axis=2)
    if HAS_B:
        acc_g += tl.load(b_ptr + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b_ptr + F + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
    g = acc_g.to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded where the eager linear rounds
    u = acc_u.to(out_ptr.dtype.element_ty).to(tl.float32)
    h = (g * tl.sigmoid(g)).to(out_ptr.dtype.element_ty).to(tl.float32) * u
    tl.store(
        out_ptr + rows[:, None] * F + cols[None, :], h.to(out_ptr.dtype.element_ty), mask=rm[:, None] & cm[None, :]
    )


def swiglu(
    y: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, block_n: int = 16, block_k: int = 128
) -> torch.Tensor:
    """(M, H) times fc1 ``w`` (2F, H) = [gate; up] (+ bias) → silu(gate) · up (M, F), one pass over ``w``."""
    y = y.contiguous()
    M, H = y.shape
    F = w.shape[0] // 2
    out = torch.empty(M, F, dtype=w.dtype, device=y.device)
    _swiglu[(triton.cdiv(F, block_n),)](
        y,
        w,
        b if b is not None else w,
        out,
        M,
        F,
        H,
        HAS_B=b is not None,
        BM=_pow2(M),
        BN=block_n,
        BK=min(block_k, _pow2(H)),
    )
    return out


@triton.jit
def _rope_write(
    mx_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    G,
    PER,
    D,
    ROT,
    sk_b,
    sk_g,
    sk_l,
    sv_b,
    sv_g,
    sv_l,
    HAS_ROPE: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    slot = pid % (PER + 2)  # per group: its q heads, then k, then v (megatron's qkv layout)
    bg = pid // (PER + 2)
    g = bg % G
    b = bg // G
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    src = mx_ptr + (bg * (PER + 2) + slot) * D
    t = tl.load(src + d, mask=dm, other=0.0)
    p = tl.load(pos_ptr)
    if HAS_ROPE:
        if slot <= PER:
            if INTERLEAVED:
                partner = d ^ 1
                neg = d % 2 == 0
            else:
                partner = (d + ROT // 2) % ROT
                neg = d < ROT // 2
            rm = d < ROT
            other = tl.load(src + partner, mask=rm, other=0.0)
            c = tl.load(cos_ptr + p * ROT + d, mask=rm, other=1.0)
            s = tl.load(sin_ptr + p * ROT + d, mask=rm, other=0.0)
            s = tl.where(neg, -s, s)  # rotate-half's minus, as the eager step folds it into sin
            t = tl.where(rm, (t * c + other * s).to(t.dtype), t)
    if slot < PER:
        tl.store(q_ptr + (bg * PER + slot) * D + d, t, mask=dm)
    elif slot == PER:
        tl.store(k_ptr + b * sk_b + g * sk_g + p * sk_l + d, t, mask=dm)
    else:
        tl.store(v_ptr + b * sv_b + g * sv_g + p * sv_l + d, t, mask=dm)


def rope_write(
    mixed: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    pos: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    heads: int,
    interleaved: bool,
) -> torch.Tensor:
    """qkv output (B, groups·(per+2)·D) → q (B, heads, D) rotated; k rotated and v written at ``pos``
    into the caches (B, groups, L, D). ``cos``/``sin``: the model's (L, rot) tables, or None."""
    B, G, _, D = k_cache.shape
    per = heads // G
    mixed = mixed.contiguous()
    q = torch.empty(B, heads, D, dtype=mixed.dtype, device=mixed.device)
    rot = cos.shape[-1] if cos is not None else 0
    assert k_cache.stride(-1) == 1
    assert v_cache.stride(-1) == 1
    _rope_write[(B * G * (per + 2),)](
        mixed,
        cos if cos is not None else mixed,
        sin if sin is not None else mixed,
        pos,
        q,
        k_cache,
        v_cache,
        G,
        per,
        D,
        max(rot, 2),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        HAS_ROPE=cos is not None,
        INTERLEAVED=interleaved,
        BLOCK_D=_pow2(D),
    )
    return q


@triton.jit
def _project(
    h_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    H,
    START,
    EOD,
    CB,
    inv_temp,
    SCALE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    rows = tl.arange(0, BM)
    nm, rm = n < N, rows < M
    wrow = tl.where(n < CB, START + n, EOD)  # the codebook's rows, then the end-of-document row
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, H, BK):
        kk = k0 + tl.arange(0, BK)
        km = kk < H
        h = tl.load(h_ptr + rows[:, None] * H + kk[None, :], mask=rm[:, None] & km[None, :], other=0.0)
        w = tl.load(w_ptr + wrow[:, None].to(tl.int64) * H + kk[None, :], mask=nm[:, None] & km[None, :], other=0.0)
        acc += tl.sum(h.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    logits = acc.to(w_ptr.dtype.element_ty).to(tl.float32)  # the eager projection's dtype, then .float()
    if SCALE:
        logits = logits / inv_temp  # ``inv_temp`` holds max(temperature, 1e-5): the eager division
    tl.store(out_ptr + rows[:, None] * N + n[None, :], logits, mask=rm[:, None] & nm[None, :])


@triton.jit
def _draw(l_ptr, q_ptr, tok_ptr, N, K, BLK: tl.constexpr):
    """One row: the top ``K`` logits by rank (no sort: a candidate's rank is how many beat it, the
    lower index first among equal ones, top-k's order), then multinomial's one-sample rule, argmax
    of p / q with q the row's exponentials in rank order; the first in rank order on a tie."""
    row = tl.program_id(0)
    base = l_ptr + row * N
    best = float("-inf")
    for n0 in range(0, N, BLK):
        n = n0 + tl.arange(0, BLK)
        best = tl.maximum(best, tl.max(tl.load(base + n, mask=n < N, other=float("-inf")), axis=0))
    top_ratio = -1.0
    top_rank = N
    top_n = 0
    for n0 in range(0, N, BLK):
        n = n0 + tl.arange(0, BLK)
        v = tl.load(base + n, mask=n < N, other=float("-inf"))
        rank = tl.zeros((BLK,), dtype=tl.int32)
        for m0 in range(0, N, BLK):
            m = m0 + tl.arange(0, BLK)
            w = tl.load(base + m, mask=m < N, other=float("-inf"))
            beats = (w[None, :] > v[:, None]) | ((w[None, :] == v[:, None]) & (m[None, :] < n[:, None]))
            rank += tl.sum((beats & (m[None, :] < N)).to(tl.int32), axis=1)
        kept = (rank < K) & (n < N)
        q = tl.load(q_ptr + row * K + rank, mask=kept, other=1.0)
        ratio = tl.where(kept, tl.exp(v - best) / q, -1.0)
        r_best = tl.max(ratio, axis=0)
        r_rank = tl.min(tl.where(ratio == r_best, rank, N), axis=0)
        if (r_best > top_ratio) | ((r_best == top_ratio) & (r_rank < top_rank)):
            top_ratio = r_best
            top_rank = r_rank
            top_n = tl.sum(tl.where(kept & (rank == r_rank), n, 0), axis=0)
    tl.store(tok_ptr + row, top_n)


def project_sample(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    start: int,
    eod: int | None,
    top_k: int,
    generators: list[torch.Generator],
    temperature: float = 1.0,
    codebook: int = 1024,
) -> torch.Tensor:
    """hidden (B, H) → one index per row in [0, codebook] (``codebook`` = the end-of-document row when
    ``eod`` is given), drawn as ``sampling.sample_rows`` draws from the same logits."""
    hidden = hidden.contiguous()
    M, H = hidden.shape
    N = codebook + (eod is not None)
    logits = torch.empty(M, N, dtype=torch.float32, device=hidden.device)
    bn = 256 if INTERPRETED else 16  # a GPU: 65 programs over the window, not 17
    _project[(triton.cdiv(N, bn),)](
        hidden,
        weight,
        logits,
        M,
        N,
        H,
        start,
        eod if eod is not None else start,
        codebook,
        max(temperature, 1e-5),
        SCALE=temperature != 1.0,
        BM=_pow2(M),
        BN=bn,
        BK=min(64, _pow2(H)),
    )
    k = max(1, min(top_k, N))
    q = torch.empty(M, k, dtype=torch.float32, device=hidden.device)
    for row, g in zip(q, generators, strict=True):  # what sample_rows consumes from each generator
        row.exponential_(generator=g)
    tokens = torch.empty(M, dtype=torch.long, device=hidden.device)
    _draw[(M,)](logits, q, tokens, N, k, BLK=512 if INTERPRETED else 128)
    return tokens
