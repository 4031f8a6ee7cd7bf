"""Adapters' files and residency: the tiny set reads back; every bad adapter is refused at load with
the file and its reason; the store never holds more than its capacity and evicts the least recently used."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from songserve.errors import RequestError
from songserve.pipeline.adapters.format import CONFIG, WEIGHTS, AdapterError, read_adapter, write_adapter
from songserve.pipeline.adapters.residency import AdapterStore, model_shape
from songserve.pipeline.adapters.safetensors_file import SafetensorsError, read_safetensors, write_safetensors
from songserve.pipeline.tiny.adapters import TINY_ADAPTERS, write_tiny_adapters
from songserve.pipeline.tiny.build import tiny_arch

ARCHS = {k: tiny_arch(k, 1024) for k in ("backbone", "superres")}
SHAPES = {k: model_shape(a) for k, a in ARCHS.items()}
BASES = {"tiny"}


@pytest.fixture(scope="module")
def tiny_adapters(tmp_path_factory):
    return write_tiny_adapters(tmp_path_factory.mktemp("adapters") / "adapters", ARCHS)


def _good(folder, rank=2, targets=("linear_qkv",), layers=(0,), base="tiny"):
    w = {}
    for layer in layers:
        for t in targets:
            n_in, n_out = SHAPES["backbone"].dims[t]
            w[(layer, t)] = (torch.ones(rank, n_in) * 0.01, torch.ones(n_out, rank) * 0.01)
    write_adapter(folder, {"backbone": w}, rank, 4.0, base)
    return folder


def _config(folder, **change):
    cfg = json.loads((folder / CONFIG).read_text())
    for k, v in change.items():
        if v is None:
            cfg.pop(k)
        else:
            cfg[k] = v
    (folder / CONFIG).write_text(json.dumps(cfg))


def _tensors(folder, edit):
    tensors = read_safetensors(folder / WEIGHTS)
    edit(tensors)
    write_safetensors(folder / WEIGHTS, tensors)


def test_the_tiny_set_reads_back_with_its_ranks_and_targets(tiny_adapters):
    for name, (rank, alpha, targets, models) in TINY_ADAPTERS.items():
        a = read_adapter(tiny_adapters / name, SHAPES, BASES)
        assert (a.rank, a.alpha, a.targets, tuple(sorted(a.weights))) == (rank, alpha, targets, tuple(sorted(models)))
        assert len(a.weights["backbone"]) == ARCHS["backbone"].num_layers * len(targets)
        assert a.scaling == alpha / rank


def test_the_tiny_set_is_deterministic(tmp_path):
    one = write_tiny_adapters(tmp_path / "one", ARCHS)
    two = write_tiny_adapters(tmp_path / "two", ARCHS)
    assert (one / "tiny-a" / WEIGHTS).read_bytes() == (two / "tiny-a" / WEIGHTS).read_bytes()


def test_safetensors_round_trip_and_its_header_rules(tmp_path):
    path = tmp_path / "x.safetensors"
    t = {"a": torch.arange(6, dtype=torch.float32).view(2, 3), "b": torch.ones(2, dtype=torch.bfloat16)}
    write_safetensors(path, t)
    back = read_safetensors(path)
    assert torch.equal(back["a"], t["a"])
    assert torch.equal(back["b"], t["b"])
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    path.write_bytes(raw[: 8 + n + 4])  # the buffer cut short
    with pytest.raises(SafetensorsError, match="data_offsets"):
        read_safetensors(path)


PROBLEMS = [
    ("missing key(s) r", lambda f: _config(f, r=None)),
    ("missing key(s) lora_alpha, target_modules", lambda f: _config(f, lora_alpha=None, target_modules=None)),
    ("rank r=0 is not an integer in 1..64", lambda f: _config(f, r=0)),
    ("rank r=100000 is not an integer in 1..64", lambda f: _config(f, r=100000)),
    ("lora_alpha=-1 is not a finite positive number", lambda f: _config(f, lora_alpha=-1)),
    ("unknown target module(s) q_proj", lambda f: _config(f, target_modules=["linear_qkv", "q_proj"])),
    (
        "trained on base model 'meta-llama/Llama-3-8B'",
        lambda f: _config(f, base_model_name_or_path="meta-llama/Llama-3-8B"),
    ),
    ("not readable JSON", lambda f: (f / CONFIG).write_text("{r: 2")),
    ("no such file", lambda f: (f / WEIGHTS).unlink()),
    ("not a safetensors file", lambda f: (f / WEIGHTS).write_bytes(b"PK\x03\x04 a zip file, not safetensors")),
    ("not a safetensors file", lambda f: torch.save({"x": torch.ones(1)}, f / WEIGHTS)),
    (
        "holds NaN or infinite values",
        lambda f: _tensors(f, lambda t: t[next(iter(t))].view(-1).__setitem__(0, float("nan"))),
    ),
    ("holds NaN or infinite values", lambda f: _tensors(f, lambda t: t[next(iter(t))].fill_(float("inf")))),
    (
        "lora_A (2, 63) and lora_B (192, 2); this model needs (2, 64) and (192, 2)",
        lambda f: _tensors(f, lambda t: t.update({k: v[:, :63] for k, v in t.items() if "lora_A" in k})),
    ),
    (
        "unknown module self_attention.linear_q",
        lambda f: _tensors(f, lambda t: t.update({k.replace("linear_qkv", "linear_q"): t.pop(k) for k in list(t)})),
    ),
    (
        "is not a LoRA tensor of an adapted module",
        lambda f: _tensors(f, lambda t: t.update({"lm_head.weight": torch.ones(2)})),
    ),
    (
        "module linear_fc1 is not in the config's target_modules",
        lambda f: _tensors(
            f, lambda t: t.update({k.replace("self_attention.linear_qkv", "mlp.linear_fc1"): t.pop(k) for k in list(t)})
        ),
    ),
    (
        "has lora_A without lora_B",
        lambda f: _tensors(f, lambda t: [t.pop(k) for k in list(t) if "lora_B" in k]),
    ),
    (
        "layer 7 of a 2-layer backbone",
        lambda f: _tensors(f, lambda t: t.update({k.replace("layers.0.", "layers.7."): t.pop(k) for k in list(t)})),
    ),
    (
        "unknown model 'vocoder'",
        lambda f: _tensors(f, lambda t: t.update({k.replace("backbone.", "vocoder."): t.pop(k) for k in list(t)})),
    ),
]


@pytest.mark.parametrize(("reason", "spoil"), PROBLEMS, ids=[p[0][:40] for p in PROBLEMS])
def test_a_bad_adapter_is_refused_at_load_naming_the_file_and_the_problem(tmp_path, reason, spoil):
    folder = _good(tmp_path / "bad")
    read_adapter(folder, SHAPES, BASES)  # good before it is spoilt
    spoil(folder)
    with pytest.raises(AdapterError) as got:
        read_adapter(folder, SHAPES, BASES)
    assert str(folder) in str(got.value)
    assert reason in str(got.value)


def test_a_superres_adapter_on_a_worker_without_superres_is_refused(tiny_adapters):
    with pytest.raises(AdapterError, match="serves no superres model"):
        read_adapter(tiny_adapters / "tiny-sr", {"backbone": SHAPES["backbone"]}, BASES)


def test_an_adapter_naming_no_base_model_or_a_path_to_this_one_is_accepted(tmp_path):
    read_adapter(_good(tmp_path / "none", base=""), SHAPES, BASES)
    read_adapter(_good(tmp_path / "path", base="/models/tiny/"), SHAPES, BASES)


def test_the_store_holds_at_most_its_capacity_and_evicts_the_least_recently_used(tmp_path):
    for i in range(6):
        _good(tmp_path / f"ad{i}", rank=1 + i % 3)
    store = AdapterStore(tmp_path, 4, SHAPES, BASES)
    assert store.available() == [f"ad{i}" for i in range(6)]
    slots = {}
    for i in range(6):
        got = store.get(f"ad{i}")
        slots[got.adapter.name] = got.slot
        assert len(store.resident()) <= 4
    assert store.resident() == ["ad2", "ad3", "ad4", "ad5"]
    assert slots["ad4"] == slots["ad0"]  # the evicted one's slot reused
    store.get("ad2")  # used again: now the most recent
    store.get("ad0", keep={"ad3"})
    assert store.resident() == ["ad3", "ad5", "ad2", "ad0"]  # ad3 was the oldest but is kept: ad4 went
    health = store.describe()
    assert health["capacity"] == 4
    assert {r["name"]: r["hits"] for r in health["resident"]}["ad2"] == 2


def test_the_store_refuses_a_batch_of_more_adapters_than_slots_and_unknown_names(tmp_path):
    for i in range(3):
        _good(tmp_path / f"ad{i}")
    store = AdapterStore(tmp_path, 2, SHAPES, BASES)
    store.get("ad0")
    store.get("ad1")
    with pytest.raises(RequestError, match="MAX_ADAPTERS=2"):
        store.get("ad2", keep={"ad0", "ad1"})
    with pytest.raises(RequestError, match="no adapter 'nope'"):
        store.get("nope")
    with pytest.raises(RequestError, match="is not an adapter name"):
        store.get("../etc")
    (tmp_path / "ad2" / CONFIG).write_text("{}")
    with pytest.raises(RequestError, match=r"Field 'adapter': adapter 'ad2' cannot be loaded: .*missing key"):
        store.get("ad2")
    assert store.resident() == ["ad0", "ad1"]  # a refused one evicts nothing


def test_a_prefetch_loads_without_counting_a_use_and_never_raises(tmp_path):
    _good(tmp_path / "ad0")
    store = AdapterStore(tmp_path, 2, SHAPES, BASES)
    store.prefetch("ad0")
    store.prefetch("nope")
    store.prefetch("../up")
    assert [(r["name"], r["hits"]) for r in store.describe()["resident"]] == [("ad0", 0)]
