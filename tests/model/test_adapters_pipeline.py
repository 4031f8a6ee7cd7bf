"""Adapters through the model pipeline on the tiny set and its tiny adapters: a mixed batch draws what
each take draws alone, scale 0 is the base model, each take records its adapter, a bad name fails
only its own take, and more adapters than slots in turn never hold more than ``MAX_ADAPTERS``."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import soundfile as sf

from songserve.audio import codes
from songserve.errors import RequestError
from songserve.pipeline.context import TaskContext
from songserve.pipeline.tiny.adapters import write_tiny_adapters
from songserve.pipeline.tiny.build import tiny_arch
from songserve.pipeline.types import TrackRequest

REQ = TrackRequest(lyrics="la la", tags="pop", duration=1 / 60, seed=7)
CAPACITY = 3


@pytest.fixture(scope="module")
def pipe(tiny_dir, megatron_cpu, tmp_path_factory):
    from songserve.pipeline.checkpoints.layout import resolve
    from songserve.pipeline.pipeline import ModelPipeline
    from songserve.worker.settings import WorkerSettings

    root = tmp_path_factory.mktemp("adapters")
    folder = write_tiny_adapters(root / "adapters", {k: tiny_arch(k, 1024) for k in ("backbone", "superres")})
    for extra in ("tiny-d", "tiny-e"):  # CAPACITY + 2 adapters in all... and then some
        shutil.copytree(folder / "tiny-c", folder / extra)
    s = WorkerSettings(
        output_dir=root / "out",
        runtime_mode="keep_loaded",
        max_batch=4,
        adapters_dir=folder,
        max_adapters=CAPACITY,
        checkpoints_dir=tiny_dir,
    )
    p = ModelPipeline(s, resolve(s), megatron_cpu)
    p.load()
    return p


def _take(pipe, reqs):
    return pipe.run_batch(reqs, [TaskContext(f"{r.task_id}-{id(r)}") for r in reqs])


def _audio(pipe, result):
    return sf.read(pipe.s.output_dir / result.wav_filename)[0]


def _req(i: int, adapter: str = "", scale: float = 1.0) -> TrackRequest:
    return dataclasses.replace(REQ, seed=10 + i, task_id=f"t{i}", adapter=adapter, adapter_scale=scale)


def test_a_mixed_batch_draws_what_each_take_draws_alone_and_records_its_adapter(pipe):
    reqs = [_req(0, "tiny-a"), _req(1), _req(2, "tiny-sr", 0.5), _req(3, "tiny-b", 2.0)]
    together = _take(pipe, reqs)
    for r, got in zip(reqs, together, strict=True):
        assert not isinstance(got, BaseException), got
        alone = _take(pipe, [r])[0]
        assert (_audio(pipe, got) == _audio(pipe, alone)).all()
        assert got.metadata["batch_size"] == 4
        if r.adapter:
            rank = {"tiny-a": 8, "tiny-sr": 4, "tiny-b": 4}[r.adapter]
            assert got.metadata["adapter"] == {"name": r.adapter, "scale": r.adapter_scale, "rank": rank}
            assert codes.read(pipe.s.output_dir / got.codes_filename).header["adapter"] == got.metadata["adapter"]
        else:
            assert "adapter" not in got.metadata
    base = _take(pipe, [_req(0)])[0]
    assert not (_audio(pipe, base) == _audio(pipe, together[0])).all()  # the adapter changes the take
    assert pipe.loaded()["adapters"]["resident"][0]["hits"] >= 2


def test_scale_zero_is_the_base_model(pipe):
    base, zero = _take(pipe, [_req(5), _req(5, "tiny-a", 0.0)])
    assert (_audio(pipe, base) == _audio(pipe, zero)).all()
    assert "adapter" not in zero.metadata


def test_an_unknown_or_broken_adapter_fails_only_its_own_take(pipe):
    (pipe.s.adapters_dir / "broken").mkdir(exist_ok=True)
    (pipe.s.adapters_dir / "broken" / "adapter_config.json").write_text('{"r": 0}')
    out = _take(pipe, [_req(6, "nope"), _req(6), _req(6, "broken")])
    assert isinstance(out[0], RequestError)
    assert "Field 'adapter'" in str(out[0])
    assert "no adapter 'nope'" in str(out[0])
    assert not isinstance(out[1], BaseException)
    assert isinstance(out[2], RequestError)
    assert "missing key(s) lora_alpha, target_modules" in str(out[2])
    shutil.rmtree(pipe.s.adapters_dir / "broken")


def test_more_adapters_than_slots_in_turn_never_hold_more_than_the_capacity(pipe):
    names = ["tiny-a", "tiny-b", "tiny-c", "tiny-d", "tiny-e"]  # CAPACITY + 2
    for i, name in enumerate(names):
        got = _take(pipe, [_req(20 + i % 5, name)])[0]
        assert not isinstance(got, BaseException), got
        health = pipe.loaded()["adapters"]
        assert len(health["resident"]) <= CAPACITY
        assert health["capacity"] == CAPACITY
    assert {"tiny-a", "tiny-e"} <= set(health["available"])
    assert pipe.adapters is not None
    assert pipe.adapters.evictions >= len(names) - CAPACITY


def test_an_adapter_that_does_not_fit_a_second_model_of_a_kind_is_a_request_error(pipe):
    from songserve.pipeline.adapters.residency import install

    assert pipe.adapters is not None
    used = pipe.adapters.get("tiny-b")
    bb = next(iter(pipe.residency.backbones.values()))
    a, b = used.adapter.weights["backbone"][(0, "linear_qkv")]
    used.adapter.weights["backbone"][(0, "linear_qkv")] = (a[:, :-1], b)  # as if shaped for another backbone
    try:
        with pytest.raises(RequestError, match="does not fit this backbone"):
            install(bb.dm, used, "backbone", CAPACITY)
    finally:
        used.adapter.weights["backbone"][(0, "linear_qkv")] = (a, b)


def test_the_live_preview_reads_its_takes_adapter_too(pipe, monkeypatch):
    from songserve.pipeline.stages.superres import SuperRes

    seen = []
    real = SuperRes.generate_batch

    def spy(self, *a, **k):
        seen.append((k.get("upto", 0), k.get("lora")))
        return real(self, *a, **k)

    monkeypatch.setattr(SuperRes, "generate_batch", spy)
    got = _take(pipe, [dataclasses.replace(_req(30, "tiny-sr"), preview=True)])[0]
    assert not isinstance(got, BaseException), got
    previews = [lora for upto, lora in seen if upto]
    assert previews
    assert all(lora is not None for lora in previews)
    assert all(lora is not None for upto, lora in seen if not upto)  # and the final pass
