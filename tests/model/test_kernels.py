"""The fused step's Triton kernels against the eager code, under Triton's interpreter on the CPU.

fp32 (the interpreter has no bf16), small shapes (the interpreter is slow), odd lengths, and the batch
sizes the worker runs (1 to MAX_BATCH's default of 4). Where triton is not installed these skip with the
reason; CI installs it (requirements-dev.txt).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton decorates the kernels
pytest.importorskip("triton", reason="triton is not installed (pip install -r requirements-dev.txt)")

from songserve.pipeline.engine import kernels as K
from songserve.pipeline.engine.kernels_attention import decode_attention, splits_for
from songserve.pipeline.engine.sampling import sample_rows
from songserve.pipeline.engine.transformer import _rotate_half

BATCHES = [1, 2, 3, 4]
H = 40  # not a power of two: every kernel masks its tail


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("b", BATCHES)
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rmsnorm_equals_eager(b, with_delta):
    g = _gen(b)
    x, d, bias, w = (torch.randn(*s, generator=g) for s in ((b, H), (b, H), (H,), (H,)))
    new_x, y = K.add_rmsnorm(x, d if with_delta else None, bias if with_delta else None, w, 1e-6)
    ref_x = x + (d + bias) if with_delta else x
    torch.testing.assert_close(new_x, ref_x, rtol=0, atol=0)
    torch.testing.assert_close(y, F.rms_norm(ref_x, (H,), w, 1e-6), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("b", BATCHES)
def test_swiglu_equals_gate_silu_times_up(b):
    g = _gen(10 + b)
    ffn = 24
    y, w, bias = torch.randn(b, H, generator=g), torch.randn(2 * ffn, H, generator=g), torch.randn(2 * ffn, generator=g)
    gate, up = F.linear(y, w, bias).chunk(2, dim=-1)
    torch.testing.assert_close(K.swiglu(y, w, bias, block_n=16, block_k=16), F.silu(gate) * up, rtol=1e-5, atol=1e-5)
    gate, up = F.linear(y, w).chunk(2, dim=-1)
    torch.testing.assert_close(K.swiglu(y, w, None), F.silu(gate) * up, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("b", [1, 3])
def test_rope_write_rotates_q_and_k_and_writes_the_cache_at_the_position(b, interleaved):
    g = _gen(20 + b)
    G, per, D, L, pos = 2, 3, 8, 11, 7  # three q heads per group, an odd cache length
    rot = 6  # rotary on part of each head (rotary_percent < 1): the tail passes through
    mixed = torch.randn(b, G * (per + 2) * D, generator=g)
    cos, sin = torch.randn(L, rot, generator=g), torch.randn(L, rot, generator=g)
    k_cache, v_cache = torch.zeros(b, G, L, D), torch.zeros(b, G, L, D)
    q = K.rope_write(mixed, cos, sin, torch.tensor([pos]), k_cache, v_cache, G * per, interleaved)

    parts = mixed.view(b, G, per + 2, D)

    def rope(t: torch.Tensor) -> torch.Tensor:  # transformer.DecodeModel._rope, the prefill's form
        t1, t2 = t[..., :rot], t[..., rot:]
        return torch.cat((t1 * cos[pos] + _rotate_half(t1, interleaved) * sin[pos], t2), dim=-1)

    assert torch.equal(q, rope(parts[:, :, :per]).reshape(b, G * per, D))
    assert torch.equal(k_cache[:, :, pos], rope(parts[:, :, per]))
    assert torch.equal(v_cache[:, :, pos], parts[:, :, per + 1])
    others = [p for p in range(L) if p != pos]
    assert not k_cache[:, :, others].any()
    assert not v_cache[:, :, others].any()


def test_rope_write_without_rope_copies():
    mixed = torch.randn(2, 1 * 3 * 4)
    k, v = torch.zeros(2, 1, 5, 4), torch.zeros(2, 1, 5, 4)
    q = K.rope_write(mixed, None, None, torch.tensor([4]), k, v, 1, False)
    parts = mixed.view(2, 1, 3, 4)
    assert torch.equal(q[:, 0], parts[:, 0, 0])
    assert torch.equal(k[:, :, 4], parts[:, :, 1])


@pytest.mark.parametrize(("b", "kv_len", "pos"), [(1, 300, 299), (2, 300, 170), (4, 77, 5), (3, 513, 0)])
def test_split_kv_attention_equals_sdpa_over_the_visible_prefix(b, kv_len, pos):
    g = _gen(kv_len + pos)
    G, per, D = 2, 2, 8
    k_cache, v_cache = torch.randn(b, G, kv_len + 3, D, generator=g), torch.randn(b, G, kv_len + 3, D, generator=g)
    q = torch.randn(b, G * per, D, generator=g)
    got = decode_attention(q, k_cache, v_cache, torch.tensor([pos]), kv_len, 0.3, block=32)
    mask = (torch.arange(kv_len) <= pos).view(1, 1, 1, kv_len)
    ref = F.scaled_dot_product_attention(
        q.unsqueeze(2), k_cache[:, :, :kv_len], v_cache[:, :, :kv_len], attn_mask=mask, scale=0.3, enable_gqa=True
    )
    torch.testing.assert_close(got, ref.reshape(b, -1), rtol=1e-5, atol=1e-5)


def test_long_positions_are_split_into_chunks():
    assert splits_for(64) == (1, 64)
    splits, chunk = splits_for(25600)
    assert 16 <= splits <= 32  # a GPU's programs: rows x groups x splits
    assert chunk * splits >= 25600 > chunk * (splits - 1)
    assert chunk % 64 == 0


@pytest.mark.parametrize(
    ("b", "eod", "top_k", "temperature"),
    [(1, None, 50, 1.0), (2, 3000, 7, 0.7), (3, None, 1, 1.0), (4, 3000, 2000, 1.0)],
)
def test_project_sample_draws_what_sample_rows_draws(b, eod, top_k, temperature):
    g = _gen(30 + b)
    weight, hidden = torch.randn(3100, H, generator=g), torch.randn(b, H, generator=g)
    start = 1024
    seeds = [100 + i for i in range(b)]
    eager_gens = [_gen(s) for s in seeds]
    fused_gens = [_gen(s) for s in seeds]
    for _ in range(2):  # two draws in a row: the generators stay in step
        logits = F.linear(hidden, weight[start : start + 1024])
        if eod is not None:
            logits = torch.cat([logits, F.linear(hidden, weight[eod : eod + 1])], dim=-1)
        want = sample_rows(logits, top_k, eager_gens, temperature)
        got = K.project_sample(hidden, weight, start, eod, top_k, fused_gens, temperature)
        assert torch.equal(got, want)
    for a, c in zip(eager_gens, fused_gens, strict=True):
        assert torch.equal(a.get_state(), c.get_state())


def test_project_sample_can_draw_the_end_of_document_row():
    weight, hidden = torch.randn(3100, H, generator=_gen(5)), torch.randn(2, H, generator=_gen(6))
    weight[3000] = hidden.sum(0) * 10  # the end-of-document row dominates both rows
    got = K.project_sample(hidden, weight, 1024, 3000, 5, [_gen(1), _gen(2)])
    assert got.tolist() == [1024, 1024]
