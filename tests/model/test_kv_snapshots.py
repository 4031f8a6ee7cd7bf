"""KV snapshots and the kept frames of a retake, in-process with the tiny set's backbone and super-resolution.

What is proved: a snapshot is restored only as far as its ids agree with the new ones and never
past the new prefix (a longer one is cut; what lies beyond is never read), a restored prefill
gives the codes a fresh one gives, the LRU stays within its bytes, a take from the prompt alone
never touches the snapshots, and super-resolution keeps every level of the kept frames.

The restored positions are the snapshot's bit for bit, and a retake of exactly the snapshot's ids
(the same point again) restores its last hidden state too, so it draws what the first retake drew;
positions prefilled after a partial restore agree with a fresh prefill to float rounding only (a
chunk of 1 row and one of 70 rows take different kernels: ≤ 2e-7 here, ≤ 2e-6 at 8 × 512), which
is why that KV is compared with a tolerance.
"""

from __future__ import annotations

import pytest
import torch

from songserve.pipeline.checkpoints.gpt_load import load_model
from songserve.pipeline.context import TaskContext
from songserve.pipeline.engine.kv_snapshots import KVSnapshots, common_prefix
from songserve.pipeline.stages import tokenizer as tk
from songserve.pipeline.stages.backbone import Backbone, Take
from songserve.pipeline.stages.length import LengthPlan
from songserve.pipeline.stages.superres import SuperRes

PROMPT = list(range(3, 40))


@pytest.fixture(scope="module")
def backbone(tiny_dir, megatron_cpu):
    tok = tk.load_tokenizer(tiny_dir / "tokenizer")
    bb = Backbone(load_model(tiny_dir / "backbone", megatron_cpu, torch.float32), tok.token_id(tk.EOD))
    bb.name = "tiny"
    return bb


@pytest.fixture(scope="module")
def superres(tiny_dir, megatron_cpu):
    return SuperRes(load_model(tiny_dir / "superres", megatron_cpu, torch.float32))


def ids_of(backbone: Backbone, kept: torch.Tensor) -> torch.Tensor:
    return torch.tensor(PROMPT + backbone.audio_ids(kept), dtype=torch.long)


def prefilled(backbone: Backbone, ids: torch.Tensor, snaps: KVSnapshots | None = None):
    """Row 0's KV after a prefill of ``ids`` (through ``snaps`` when given), and how much was restored."""
    cache = backbone.dm.new_cache(1, len(ids) + 8)
    start = 0
    if snaps is not None:
        start, _, _ = snaps.restore("tiny", ids, cache.rows(0, 1))
        start = min(start, len(ids) - 1)  # the prefill's own hidden state, to compare the KV it writes
    backbone.prefill([int(x) for x in ids], cache, [TaskContext("t")], start=start)
    return cache, start


def retake(backbone: Backbone, kept: torch.Tensor, frames: int, seed: int) -> tuple[torch.Tensor, dict]:
    take = Take(torch.Generator().manual_seed(seed), TaskContext(f"s{seed}"))
    plan = LengthPlan(frames, frames, 2 * frames)
    got = backbone.generate_batch(PROMPT, plan, [take], top_k=50, temperature=1.0, kept=kept, origin="o")[0]
    assert got is not None
    return got.codes, got.prefill


def coarse(frames: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 1024, (2, frames), generator=torch.Generator().manual_seed(seed))


def test_common_prefix():
    a = torch.tensor([1, 2, 3, 4])
    assert common_prefix(a, torch.tensor([1, 2, 3, 4, 5])) == 4
    assert common_prefix(a, torch.tensor([1, 2, 9])) == 2
    assert common_prefix(a, torch.tensor([7])) == 0
    assert common_prefix(a, torch.tensor([], dtype=torch.long)) == 0


def test_a_longer_snapshot_is_cut_to_the_new_prefix_and_nothing_past_it_is_read(backbone):
    snaps = KVSnapshots(1 << 30)
    long_ids = ids_of(backbone, coarse(60))
    cache, _ = prefilled(backbone, long_ids)
    snaps.save("tiny", long_ids, cache.rows(0, 1), "o")
    short = long_ids[:70]
    for t in (*snaps._slots[0].k, *snaps._slots[0].v):
        t[:, 69:] = float("nan")  # past the new prefix's last restorable position: must never be copied
    fresh, _ = prefilled(backbone, short)
    got, restored = prefilled(backbone, short, snaps)
    assert restored == 69  # the new prefix less its last id, which is always prefilled
    snap = snaps._slots[0]
    for a, b, kept in zip((*got.k, *got.v), (*fresh.k, *fresh.v), (*snap.k, *snap.v), strict=True):
        assert not torch.isnan(a).any()
        assert torch.equal(a[0, :, :69], kept[:, :69])
        torch.testing.assert_close(a[:, :, :70], b[:, :, :70], rtol=0, atol=1e-5)


def test_a_snapshot_that_differs_after_position_d_restores_d_positions(backbone):
    snaps = KVSnapshots(1 << 30)
    kept = coarse(40, seed=1)
    ids = ids_of(backbone, kept)
    cache, _ = prefilled(backbone, ids)
    snaps.save("tiny", ids, cache.rows(0, 1), "o")
    other = kept.clone()
    other[0, 25] = (other[0, 25] + 1) % 1024  # the frame 25's q0 differs: id 37 + 50 differs
    new = ids_of(backbone, other)
    d = len(PROMPT) + 50
    for t in (*snaps._slots[0].k, *snaps._slots[0].v):
        t[:, d:] = float("nan")
    got, restored = prefilled(backbone, new, snaps)
    fresh, _ = prefilled(backbone, new)
    assert restored == d
    for a, b in zip((*got.k, *got.v), (*fresh.k, *fresh.v), strict=True):
        assert not torch.isnan(a).any()
        torch.testing.assert_close(a[:, :, : len(new)], b[:, :, : len(new)], rtol=0, atol=1e-5)
    assert snaps.restore("other-model", new, cache.rows(0, 1))[0] == 0  # the model is part of the key
    whole, _, h = snaps.restore("tiny", ids, cache.rows(0, 1))
    assert (whole, h is None) == (len(ids) - 1, True)  # saved without its hidden state: the last id is prefilled


def test_a_second_retake_of_a_prefix_prefills_one_token_and_draws_the_same_codes(backbone):
    backbone.snapshots = KVSnapshots(1 << 30)
    try:
        kept = coarse(200, seed=2)
        first, p1 = retake(backbone, kept, 230, seed=5)
        second, p2 = retake(backbone, kept, 230, seed=5)
        later, p3 = retake(backbone, kept[:, :120], 230, seed=5)  # an earlier point: the snapshot is cut
    finally:
        backbone.snapshots = None
    n = len(PROMPT) + 400
    assert (p1["tokens"], p1["restored"]) == (n, 0)
    assert (p2["tokens"], p2["restored"]) == (n, n)  # the same point: its KV and last hidden state
    assert n - p2["restored"] <= 0.1 * (n - p1["restored"])  # prefilled tokens: ≤ 10 % of the first's (none)
    assert (p3["tokens"], p3["restored"]) == (len(PROMPT) + 240, len(PROMPT) + 239)
    assert torch.equal(first, second)  # bit for bit: nothing was recomputed
    assert torch.equal(first[:, :200], kept)
    assert torch.equal(later[:, :120], kept[:, :120])
    assert first.shape == (2, 230)


def test_a_take_from_the_prompt_alone_never_touches_the_snapshots(backbone):
    backbone.snapshots = KVSnapshots(1 << 30)
    try:
        take = Take(torch.Generator().manual_seed(1), TaskContext("p"))
        got = backbone.generate_batch(PROMPT, LengthPlan(20, 20, 40), [take], top_k=50, temperature=1.0)[0]
        assert got is not None
        assert got.prefill["restored"] == 0
        assert backbone.snapshots.describe()["slots"] == []
    finally:
        backbone.snapshots = None


def test_the_lru_stays_within_its_bytes_and_drops_what_a_longer_slot_serves(backbone):
    ids = [ids_of(backbone, coarse(30, seed=s)) for s in range(3)]
    caches = [prefilled(backbone, i)[0] for i in ids]
    per_slot = len(ids[0]) * sum(t[0, :, :1].numel() * 4 for t in (*caches[0].k, *caches[0].v))
    snaps = KVSnapshots(2 * per_slot + 10)
    assert snaps.save("tiny", ids[0], caches[0].rows(0, 1), "a")
    assert snaps.save("tiny", ids[1], caches[1].rows(0, 1), "b")
    snaps.restore("tiny", ids[0], backbone.dm.new_cache(1, len(ids[0])).rows(0, 1))  # "a" used last: "b" is older
    assert snaps.save("tiny", ids[2], caches[2].rows(0, 1), "c")
    assert [s["origin"] for s in snaps.describe()["slots"]] == ["a", "c"]
    assert snaps.describe()["bytes"] <= snaps.capacity
    assert not snaps.save("tiny", ids[2][:40], caches[2].rows(0, 1), "c")  # "c" serves that prefix already
    longer = ids_of(backbone, torch.cat([coarse(30, seed=2), coarse(5, seed=9)], dim=1))
    assert torch.equal(longer[: len(ids[2])], ids[2])
    assert snaps.save("tiny", longer, prefilled(backbone, longer)[0].rows(0, 1), "c2")
    assert [s["origin"] for s in snaps.describe()["slots"]] == ["c2"]  # over the cap with "a", and "c" is served
    assert not KVSnapshots(100).save("tiny", ids[0], caches[0].rows(0, 1), "x")  # larger than the whole bound


def test_superres_keeps_every_level_of_the_kept_frames_and_samples_the_rest(superres):
    g = torch.Generator().manual_seed(3)
    known = torch.randint(0, 1024, (64, 30), generator=g)
    frames = torch.cat([known[:2], coarse(20, seed=4)], dim=1)  # the backbone keeps q0/q1 of the kept frames
    ctx = TaskContext("sr")
    out = superres.generate_batch(PROMPT, [frames], top_k=10, generators=[g], ctxs=[ctx], known=known)[0]
    assert out.shape == (64, 50)
    assert torch.equal(out[:, :30], known)
    assert torch.equal(out[:2], frames)
    assert ((out[2:, 30:] >= 0) & (out[2:, 30:] < 1024)).all()


def test_superres_windows_of_kept_frames_only_are_copied_and_the_rest_sampled(superres):
    import dataclasses

    small = SuperRes(superres.gpt)
    small.gpt = type(superres.gpt).__new__(type(superres.gpt))
    small.gpt.__dict__.update(superres.gpt.__dict__)
    small.gpt.arch = dataclasses.replace(superres.gpt.arch, max_sequence_length=len(PROMPT) + 10)  # 10-frame windows
    g = torch.Generator().manual_seed(6)
    known = torch.randint(0, 1024, (64, 23), generator=g)  # two whole windows and 3 frames of the third
    frames = torch.cat([known[:2], coarse(12, seed=7)], dim=1)
    seen: list[int] = []
    forward = small.dm.forward
    small.dm.forward = lambda x, **kw: (seen.append(x.shape[1]), forward(x, **kw))[1]  # type: ignore[method-assign]
    out = small.generate_batch(PROMPT, [frames], top_k=10, generators=[g], ctxs=[TaskContext("w")], known=known)[0]
    assert torch.equal(out[:, :23], known)
    assert set(seen) == {len(PROMPT) + 10, len(PROMPT) + 5}  # windows 3 and 4 ran (62 passes each); 1 and 2 did not
    assert len(seen) == 2 * 62


def test_several_retakes_of_one_prefix_are_one_batch_prefilled_once(backbone):
    kept = coarse(50, seed=8)
    takes = [Take(torch.Generator().manual_seed(s), TaskContext(f"b{s}")) for s in (1, 2)]
    got = backbone.generate_batch(PROMPT, LengthPlan(70, 70, 140), takes, top_k=50, temperature=1.0, kept=kept)
    alone = [retake(backbone, kept, 70, seed=s)[0] for s in (1, 2)]
    for one, single in zip(got, alone, strict=True):
        assert one is not None
        assert one.prefill["tokens"] == len(PROMPT) + 100  # one prefill, its KV copied to both rows
        assert torch.equal(one.codes, single)  # each take draws what it draws alone
