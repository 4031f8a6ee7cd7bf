"""LoRA adapters in the engine: a take on an adapter is the take on the merged model, scale 0 is the
base model bitwise, and in a mixed batch each row draws what it draws alone, eagerly and compiled.

One release-family backbone (RMSNorm, SwiGLU, grouped-query attention, RoPE, biases) at tiny widths,
random weights; adapters made here in memory and installed into the engine's slots.
"""

from __future__ import annotations

import pytest
import torch

from songserve.pipeline.context import TaskContext
from songserve.pipeline.engine.decode_step import DecodeStep
from songserve.pipeline.engine.gpt import AcousticGPT, build_model
from songserve.pipeline.engine.kv_snapshots import KVSnapshots
from songserve.pipeline.engine.lora import TARGETS, row_lora
from songserve.pipeline.stages.backbone import Backbone, Take, TakeLoRA
from songserve.pipeline.stages.length import LengthPlan
from songserve.pipeline.tiny.build import release_arch

PROMPT = list(range(3, 23))
EOD = 1
KV = 64
SLOTS, RANK = 4, 8
FRAMES = 12


def _adapter(dm, rank: int, seed: int, size: float = 0.3):
    """(layer, target) → (A (r, in), B (out, r)) for every layer and target."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(len(dm.layers)):
        for t, (n_in, n_out) in dm.lora_dims().items():
            a = torch.randn(rank, n_in, generator=g) * size / n_in**0.5
            b = torch.randn(n_out, rank, generator=g) * size
            out[(i, t)] = (a, b)
    return out


def _merged(arch, model, weights, factor: float):
    merged = build_model(arch, torch.device("cpu"), torch.float32)
    merged.load_state_dict(model.state_dict())
    with torch.no_grad():
        for (i, t), (a, b) in weights.items():
            layer = merged.decoder.layers[i]
            part = layer.self_attention if t in ("linear_qkv", "linear_proj") else layer.mlp
            getattr(part, t).weight += factor * (b @ a)
    return merged


@pytest.fixture(scope="module")
def parts(megatron_cpu):
    torch.manual_seed(0)
    arch = release_arch("backbone", 256)
    model = build_model(arch, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        for layer in model.decoder.layers:
            layer.self_attention.linear_qkv.bias.normal_()
    bb = Backbone(AcousticGPT(arch, model), EOD)
    slots = bb.dm.lora_slots(SLOTS, RANK)
    adapters = {n: _adapter(bb.dm, r, seed=n) for n, r in ((1, 8), (2, 4), (3, 2))}
    for n, w in adapters.items():
        slots.install(n, f"a{n}", w)
    return arch, model, bb, adapters


def _run(bb: Backbone, seeds: list[int], loras: list[TakeLoRA | None]):
    takes = [
        Take(torch.Generator().manual_seed(s), TaskContext(f"take{s}"), lo) for s, lo in zip(seeds, loras, strict=True)
    ]
    with torch.inference_mode():
        out = bb.generate_batch(PROMPT, LengthPlan(FRAMES, FRAMES, 2 * FRAMES), takes, top_k=20, temperature=0.9)
    return [r.codes for r in out]


def _use(n: int, scale: float = 1.0) -> TakeLoRA:
    rank = {1: 8, 2: 4, 3: 2}[n]
    return TakeLoRA(n, scale * 16.0 / rank, f"a{n}@{scale}", rank)


def test_a_take_on_an_adapter_is_the_take_on_the_merged_model(parts):
    arch, model, bb, adapters = parts
    merged_bb = Backbone(AcousticGPT(arch, _merged(arch, model, adapters[2], 0.5 * 16.0 / 4)), EOD)
    ids = torch.tensor(PROMPT).view(1, -1)
    pos = torch.arange(len(PROMPT)).view(1, -1)
    with torch.inference_mode():
        rows = row_lora([2], [0.5 * 16.0 / 4], bb.dm.device, bb.dm.dtype, [4])
        assert rows is not None
        assert rows.rank == 8  # the slots' first 8 columns of 64 are read
        h = bb.dm.forward(bb.dm.embed(ids, pos), lora=rows)
        h_all = bb.dm.forward(bb.dm.embed(ids, pos), lora=rows._replace(rank=0))
        h_merged = merged_bb.dm.forward(merged_bb.dm.embed(ids, pos))
        logits, want = bb.gpt.project(h, 0, 2048), merged_bb.gpt.project(h_merged, 0, 2048)
        base = bb.gpt.project(bb.dm.forward(bb.dm.embed(ids, pos)), 0, 2048)
    assert (logits - want).abs().max() < 1e-5
    assert (h - h_all).abs().max() < 1e-6  # the zero-padded columns add (about) nothing
    assert (logits - base).abs().max() > 1e-2
    got = _run(bb, [11], [_use(2, 0.5)])[0]
    assert torch.equal(got, _run(merged_bb, [11], [None])[0])
    assert not torch.equal(got, _run(bb, [11], [None])[0])  # the adapter changes what is drawn


def test_scale_zero_and_no_adapter_are_the_base_step_bitwise(parts):
    _, _, bb, _ = parts
    assert row_lora([1, 2], [0.0, 0.0], bb.dm.device, bb.dm.dtype) is None  # no delta computed at all
    cache = bb.dm.new_cache(1, KV)
    bb.dm.rope_tables(KV)
    args = (torch.tensor([5]), torch.tensor([0]), cache.k, cache.v, KV, True)
    with torch.inference_mode():
        assert torch.equal(bb.dm.step(*args), bb.dm.step(*args, None))


def test_in_a_mixed_batch_each_row_draws_what_it_draws_alone(parts):
    _, _, bb, _ = parts
    loras = [_use(1), None, _use(2), _use(3, 2.0)]
    alone = [_run(bb, [20 + i], [lo])[0] for i, lo in enumerate(loras)]
    together = _run(bb, [20, 21, 22, 23], loras)
    for a, b in zip(alone, together, strict=True):
        assert torch.equal(a, b)
    assert len({tuple(c.flatten().tolist()) for c in alone}) == 4


def test_the_prompt_is_prefilled_once_per_distinct_adapter(parts, monkeypatch):
    _, _, bb, _ = parts
    calls = []
    real = bb.prefill
    monkeypatch.setattr(bb, "prefill", lambda *a, **k: calls.append(k.get("lora")) or real(*a, **k))
    _run(bb, [1, 2, 3, 4, 5], [_use(1), None, _use(1), _use(2), None])
    assert len(calls) == 3


def test_a_snapshot_made_without_an_adapter_is_never_restored_for_a_take_with_one(parts, monkeypatch):
    _, _, bb, _ = parts
    snaps = KVSnapshots(64 * 2**20)
    monkeypatch.setattr(bb, "snapshots", snaps)
    monkeypatch.setattr(bb, "name", "m")
    kept = torch.randint(0, 1024, (2, 4))
    plan = LengthPlan(FRAMES, FRAMES, 2 * FRAMES)

    def restored(lora):
        take = Take(torch.Generator().manual_seed(3), TaskContext("t"), lora)
        with torch.inference_mode():
            got = bb.generate_batch(PROMPT, plan, [take], top_k=20, temperature=0.9, kept=kept, origin="o")[0]
        return got.prefill["restored"]

    assert restored(None) == 0
    assert restored(_use(1)) == 0  # the base model's snapshot is not this adapter's
    assert restored(_use(1)) == len(PROMPT) + 8  # its own is
    assert restored(_use(1, 2.0)) == 0  # nor another scale's
    assert restored(None) == len(PROMPT) + 8


def test_installing_into_a_slot_replaces_it_in_place(parts):
    _, _, bb, adapters = parts
    slots = bb.dm.lora
    before = slots.A["linear_qkv"].data_ptr()
    slots.install(4, "x", {k: v for k, v in adapters[3].items() if k[1] in TARGETS[:2]})
    assert slots.A["linear_qkv"].data_ptr() == before
    assert slots.A["linear_qkv"][4, 0].abs().sum() > 0
    assert slots.A["linear_fc1"][4].abs().sum() == 0  # a target it does not adapt stays zero
    slots.clear(4)
    assert slots.held[4] is None


@pytest.mark.parametrize("mode", ["graphs", "compiled"])
def test_every_cpu_mode_draws_the_eager_tokens_with_adapters(parts, monkeypatch, mode):
    _, _, bb, adapters = parts
    monkeypatch.setattr(bb, "bucket", KV)
    loras = [_use(1), None, _use(3, 2.0)]
    eager = _run(bb, [31, 32, 33], loras)
    step = DecodeStep(bb.dm, mode, bb.gpt.arch.context_length)
    monkeypatch.setattr(bb, "compiled", step)
    got = _run(bb, [31, 32, 33], loras)
    assert step.failed is None, step.describe()
    for a, b in zip(eager, got, strict=True):
        assert torch.equal(a, b)
    # a slot refilled in place: the same graph reads the new adapter
    bb.dm.lora.install(3, "a3b", _adapter(bb.dm, 2, seed=99))
    again = _run(bb, [31, 32, 33], loras)
    monkeypatch.setattr(bb, "compiled", None)
    fresh = _run(bb, [31, 32, 33], loras)
    bb.dm.lora.install(3, "a3", adapters[3])
    assert torch.equal(again[2], fresh[2])
    assert not torch.equal(again[2], eager[2])
    assert torch.equal(again[0], eager[0])


def test_the_fused_step_draws_the_eager_tokens_with_adapters(parts, monkeypatch):
    """Its kernels and the rows' deltas between them (under Triton's interpreter on the CPU)."""
    pytest.importorskip("triton", reason="triton is not installed (pip install -r requirements-dev.txt)")
    _, _, bb, _ = parts
    monkeypatch.setattr(bb, "bucket", KV)
    monkeypatch.setattr("tests.model.test_adapters_engine.FRAMES", 3)  # the interpreter runs each kernel in Python
    loras = [_use(1), None, _use(3, 2.0)]
    eager = _run(bb, [41, 42, 43], loras)
    step = DecodeStep(bb.dm, "fused", bb.gpt.arch.context_length)
    monkeypatch.setattr(bb, "compiled", step)
    got = _run(bb, [41, 42, 43], loras)
    assert step.failed is None, step.describe()
    for a, b in zip(eager, got, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(got[0], _run(bb, [41], [None])[0])


class _CancelledAtFirstCheck(TaskContext):
    """Cancelled once the loop first asks after the prefill (its check after 16 tokens)."""

    def __init__(self, task_id: str) -> None:
        super().__init__(task_id)
        self.asked = 0

    def cancelled(self) -> bool:
        self.asked += 1
        return self.asked > 1  # the prefill's own question is the first


def test_a_batch_that_drops_a_row_keeps_each_rows_adapter(parts):
    """Rows 0 and 2 on different adapters, row 1 cancelled at the first check: the batch shrinks to
    rows 0 and 2, and each still draws what it draws alone (its adapter follows it)."""
    _, _, bb, _ = parts
    loras = [_use(1), _use(2), _use(3, 2.0)]
    alone = [_run(bb, [50 + i], [lo])[0] for i, lo in enumerate(loras)]
    takes = [
        Take(torch.Generator().manual_seed(50 + i), ctx, lo)
        for i, (ctx, lo) in enumerate(
            zip([TaskContext("a"), _CancelledAtFirstCheck("b"), TaskContext("c")], loras, strict=True)
        )
    ]
    with torch.inference_mode():
        out = bb.generate_batch(PROMPT, LengthPlan(FRAMES, FRAMES, 2 * FRAMES), takes, top_k=20, temperature=0.9)
    assert out[1] is None
    assert torch.equal(out[0].codes, alone[0])
    assert torch.equal(out[2].codes, alone[2])
