"""KV snapshots restored in any order, and faults inside the cache, in-process with the tiny set's backbone.

Moving a slot to the LRU's end with ``list.remove`` compares it with every slot before it; were that a
dataclass's field-by-field ``==`` (ids and KV tensors), restoring any slot that is not the first would
raise, and keep raising on that worker. What is proved here:

- several snapshots of different lengths restore in every order, each its own KV bit for bit;
- takes of a batch and requests after it, retaking several prefixes in turn, each restore their own
  snapshot and draw what a take with no snapshots draws;
- a fault inside the cache (a slot whose KV cannot be copied, a save that cannot copy) is a miss: the
  take prefills its whole prefix and draws the same codes, the fault is counted in ``describe``;
- a take that still fails after such a fault is the worker's (``ErrorKind.environment``: retried on
  another worker), not the model's.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from songserve.errors import WorkerStateError
from songserve.pipeline.checkpoints.gpt_load import load_model
from songserve.pipeline.context import TaskContext
from songserve.pipeline.engine.kv_cache import KVCache
from songserve.pipeline.engine.kv_snapshots import KVSnapshots
from songserve.pipeline.stages import tokenizer as tk
from songserve.pipeline.stages.backbone import Backbone, Take
from songserve.pipeline.stages.length import LengthPlan
from songserve.schemas import ErrorKind
from songserve.worker.failures import error_kind_of

PROMPT = list(range(3, 40))


@pytest.fixture(scope="module")
def backbone(tiny_dir, megatron_cpu):
    tok = tk.load_tokenizer(tiny_dir / "tokenizer")
    bb = Backbone(load_model(tiny_dir / "backbone", megatron_cpu, torch.float32), tok.token_id(tk.EOD))
    bb.name = "tiny"
    return bb


def random_cache(n: int, seed: int) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    return KVCache(
        [torch.randn(1, 2, n, 4, generator=g) for _ in range(3)],
        [torch.randn(1, 2, n, 4, generator=g) for _ in range(3)],
    )


def coarse(frames: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 1024, (2, frames), generator=torch.Generator().manual_seed(seed))


def takes(seeds: tuple[int, ...], name: str) -> list[Take]:
    return [Take(torch.Generator().manual_seed(s), TaskContext(f"{name}{s}")) for s in seeds]


def batch(backbone: Backbone, kept: torch.Tensor, seeds: tuple[int, ...], name: str) -> list:
    frames = kept.shape[1] + 12
    got = backbone.generate_batch(
        PROMPT,
        LengthPlan(frames, frames, 2 * frames),
        takes(seeds, name),
        top_k=50,
        temperature=1.0,
        kept=kept,
        origin=name,
    )
    assert all(g is not None for g in got)
    return got


def test_snapshots_of_different_lengths_restore_in_every_order():
    lengths = (9, 23, 40, 64)
    ids = [torch.arange(n) + 1000 * i for i, n in enumerate(lengths)]  # no two share a first id
    sources = [random_cache(n, seed=i) for i, n in enumerate(lengths)]
    for order in itertools.permutations(range(len(lengths))):
        snaps = KVSnapshots(1 << 30)
        for i in range(len(lengths)):
            assert snaps.save("m", ids[i], sources[i], f"s{i}", h=torch.full((1, 4), float(i)))
        for i in (*order, *order):  # every slot from every position of the LRU, twice
            dst = KVCache([torch.zeros(1, 2, 70, 4) for _ in range(3)], [torch.zeros(1, 2, 70, 4) for _ in range(3)])
            n, origin, h = snaps.restore("m", ids[i], dst, "t")
            assert (n, origin) == (lengths[i], f"s{i}")
            assert h is not None
            assert float(h[0, 0]) == i
            for a, b in zip((*dst.k, *dst.v), (*sources[i].k, *sources[i].v), strict=True):
                assert torch.equal(a[:, :, : lengths[i]], b)
            assert [s["origin"] for s in snaps.describe()["slots"]][-1] == f"s{i}"  # most recently used last
        assert snaps.faults == 0
        assert sorted(s["hits"] for s in snaps.describe()["slots"]) == [2, 2, 2, 2]


def test_retakes_of_several_prefixes_across_a_batch_and_requests_restore_their_own(backbone):
    kepts = {name: coarse(frames, seed) for name, frames, seed in (("a", 30, 1), ("b", 45, 2), ("c", 20, 3))}
    fresh = {name: batch(backbone, kept, (7, 8), name) for name, kept in kepts.items()}  # no snapshots at all
    backbone.snapshots = KVSnapshots(1 << 30)
    try:
        for name in ("a", "b", "c"):  # saved in this order: a is first in the LRU, c last
            first = batch(backbone, kepts[name], (7, 8), name)
            assert [r.prefill["restored"] for r in first] == [0 if name == "a" else len(PROMPT)] * 2  # the prompt
        for name in ("b", "a", "c", "b", "b", "a"):  # each one from a slot that is not the first
            again = batch(backbone, kepts[name], (7, 8), name)
            n = len(PROMPT) + 2 * kepts[name].shape[1]
            for got, want in zip(again, fresh[name], strict=True):
                assert (got.prefill["tokens"], got.prefill["restored"]) == (n, n)
                assert torch.equal(got.codes, want.codes)  # what the take draws with no snapshots
        assert backbone.snapshots.faults == 0
        assert [s["origin"] for s in backbone.snapshots.describe()["slots"]] == ["c", "b", "a"]
    finally:
        backbone.snapshots = None


def test_a_fault_inside_the_cache_is_a_miss_and_the_take_draws_the_same_codes(backbone, caplog):
    kept, kept_y = coarse(30, seed=4), coarse(22, seed=6)
    want, want_y = batch(backbone, kept, (5,), "w")[0], batch(backbone, kept_y, (5,), "y")[0]
    snaps = backbone.snapshots = KVSnapshots(1 << 30)
    try:
        batch(backbone, coarse(25, seed=5), (5,), "x")
        batch(backbone, kept, (5,), "w")
        slot = snaps._slots[1]  # "w", not the first slot
        slot.k[0] = slot.k[0][:, :3]  # a slot whose KV no longer fits the cache: its copy raises
        got = batch(backbone, kept, (5,), "retry")[0]
        assert got.prefill["restored"] == 0  # a miss: the whole prefix prefilled
        assert torch.equal(got.codes, want.codes)
        assert snaps.describe()["faults"] == 1
        assert "task retry5: kv snapshot restore failed" in caplog.text
        assert [s["origin"] for s in snaps.describe()["slots"]] == ["retry"]  # dropped, then this prefill kept

        original = snaps._save
        snaps._save = lambda *a: (_ for _ in ()).throw(RuntimeError("injected"))  # type: ignore[method-assign]
        other = batch(backbone, kept_y, (5,), "y")[0]  # a save that fails: the take is not touched
        snaps._save = original  # type: ignore[method-assign]
        assert other.prefill["restored"] == len(PROMPT)  # the prompt, from "retry"
        assert torch.equal(other.codes, want_y.codes)
        assert snaps.describe()["faults"] == 2
        assert snaps.describe()["slots"] == []
        again = batch(backbone, kept, (5,), "z")[0]  # the cache works again
        assert torch.equal(again.codes, want.codes)
        assert batch(backbone, kept, (5,), "z")[0].prefill["restored"] == again.prefill["tokens"]
    finally:
        backbone.snapshots = None


def test_a_take_that_fails_after_a_fault_in_the_cache_is_the_workers_not_the_models(backbone):
    kept = coarse(20, seed=7)
    snaps = backbone.snapshots = KVSnapshots(1 << 30)
    try:
        batch(backbone, kept, (1,), "a")
        snaps._slots[0].v[1] = snaps._slots[0].v[1][:, :2]  # the restore will fault
        prefill = backbone.prefill
        backbone.prefill = lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("device lost"))  # type: ignore[method-assign]
        with pytest.raises(WorkerStateError) as err:
            batch(backbone, kept, (1,), "b")
        assert error_kind_of(err.value) is ErrorKind.environment  # the dispatcher retries it on another worker
        with pytest.raises(RuntimeError, match="device lost") as plain:  # no fault in the cache: the model's
            batch(backbone, kept, (1,), "c")
        assert not isinstance(plain.value, WorkerStateError)
    finally:
        backbone.prefill = prefill  # type: ignore[method-assign]
        backbone.snapshots = None
