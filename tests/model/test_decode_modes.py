"""The decode step's modes: every mode draws the eager tokens; the compiled step has no
graph break, no host sync and stays within its kernel budget.

One release-family model (RMSNorm, SwiGLU, grouped-query attention, RoPE, qkv biases) at tiny widths,
random weights, built once. inductor compiles on these CPUs take ~10 s a graph: each shape is compiled
once per module.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from songserve.pipeline.context import TaskContext
from songserve.pipeline.engine.decode_step import MODES, DecodeStep, choose_mode
from songserve.pipeline.engine.gpt import AcousticGPT, build_model
from songserve.pipeline.engine.transformer import DecodeModel
from songserve.pipeline.stages.backbone import Backbone, Take
from songserve.pipeline.stages.length import LengthPlan
from songserve.pipeline.tiny.build import release_arch

PROMPT = list(range(3, 23))
EOD = 1
KV = 64  # one KV bucket covers prompt + song: one compile per batch size
# inductor's kernels for the step (CPU code generation: a loop nest each), per transformer layer and
# outside the layers (embedding, position tables, final norm). DecodeModel.step meets it (12 a layer);
# the unfused step, kept as a reference (``_unfused_step``), needs 15 a layer.
KERNELS_PER_LAYER = 12
KERNELS_OUTSIDE = 3


def _model(layers: int) -> DecodeModel:
    arch = dataclasses.replace(release_arch("backbone", 256), num_layers=layers)
    model = build_model(arch, torch.device("cpu"), torch.float32)
    with torch.no_grad():  # biases start at zero: make them matter
        for layer in model.decoder.layers:
            layer.self_attention.linear_qkv.bias.normal_()
    return DecodeModel(model, AcousticGPT(arch, model).output_weight)


@pytest.fixture(scope="module")
def backbone(megatron_cpu):
    torch.manual_seed(0)
    arch = release_arch("backbone", 256)
    model = build_model(arch, torch.device("cpu"), torch.float32)
    return Backbone(AcousticGPT(arch, model), EOD)


def _run(bb: Backbone, seeds: list[int], frames: int = 20):
    takes = [Take(torch.Generator().manual_seed(s), TaskContext(f"take{s}")) for s in seeds]
    with torch.inference_mode():
        out = bb.generate_batch(PROMPT, LengthPlan(frames, frames, 2 * frames), takes, top_k=20, temperature=0.9)
    return [r.codes for r in out]


def test_auto_keeps_what_compile_chose():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert choose_mode("auto", "auto", cuda) == "graphs"  # the worker's default on CUDA, as before
    assert choose_mode("auto", "1", cuda) == "graphs"
    assert choose_mode("auto", "0", cuda) == "eager"
    assert choose_mode("auto", "auto", cpu) == "eager"
    assert choose_mode("auto", "1", cpu) == "compiled"
    assert [choose_mode(m, "0", cpu) for m in MODES] == list(MODES)


def test_decode_mode_setting_refuses_an_unknown_mode():
    from pydantic import ValidationError

    from songserve.worker.settings import WorkerSettings

    with pytest.raises(ValidationError, match="decode_mode"):
        WorkerSettings(decode_mode="turbo")


def test_graphs_mode_replays_over_its_persistent_cache(backbone, monkeypatch):
    """On the CPU no graph is captured, but the bookkeeping a capture needs runs: static token and
    position buffers, one cache whose first rows each batch uses, a graph per (batch, bucket)."""
    monkeypatch.setattr(backbone, "bucket", KV)
    step = DecodeStep(backbone.dm, "graphs", backbone.gpt.arch.context_length)
    monkeypatch.setattr(backbone, "compiled", step)
    step.warm([1, 2], [KV])
    assert step.graphs == {(1, KV), (2, KV)}
    assert step.describe()["kv_rows"] == 2
    assert step.kv_bytes_new(2, 100) == 0
    assert not step.can_shrink(1, KV)
    _run(backbone, [1, 2])
    assert step.graphs == {(1, KV), (2, KV)}  # replayed, nothing new recorded


def test_a_mode_that_cannot_run_falls_back_to_eager_with_the_reason(megatron_cpu):
    pytest.importorskip("triton", reason="triton is not installed (pip install -r requirements-dev.txt)")
    plain = _model(1)
    plain.spec = dataclasses.replace(plain.spec, normalization="LayerNorm")  # not what the kernels cover
    step = DecodeStep(plain, "fused", 128)
    assert step.failed is not None
    assert "RMSNorm" in step.failed
    assert step.describe()["mode"] == "eager"
    assert step.sampler is None


# ---- the compiler as the first fuser -------------------------------------------------------------


def _unfused_step(dm, tokens, pos, k_cache, v_cache, kv_len, masked):
    """The unfused step, kept as a reference for ``DecodeModel.step``: q and k rotated apart (a concatenation each),
    K/V transposed out of the qkv layout."""
    s = dm.spec
    B = tokens.shape[0]
    x = F.embedding(tokens.view(B, 1), dm.word)
    cos = dm._rope_cos.index_select(0, pos)
    sin = dm._rope_sin.index_select(0, pos)
    mask = (torch.arange(kv_len) <= pos).view(1, 1, 1, kv_len) if masked else None
    for i, lw in enumerate(dm.layers):
        q, k, v = dm._qkv(lw, x)
        q, k = dm._rope(q, cos, sin), dm._rope(k, cos, sin)
        k_cache[i].index_copy_(2, pos, k)
        v_cache[i].index_copy_(2, pos, v)
        o = F.scaled_dot_product_attention(
            q, k_cache[i][:, :, :kv_len], v_cache[i][:, :, :kv_len], attn_mask=mask, scale=s.scale, enable_gqa=True
        )
        x = dm._finish_layer(lw, x, o.reshape(B, 1, -1))
    return dm.final(x)[:, 0]


def _kernels(fn, dm: DecodeModel) -> int:
    """inductor's generated kernels for one compile of ``fn`` at batch 2 (fullgraph: a break raises)."""
    from torch._inductor import metrics

    torch._dynamo.reset()
    torch._inductor.config.compile_threads = 1  # no pool of compile workers to start on 2 cores
    metrics.reset()
    cache = dm.new_cache(2, KV)
    dm.rope_tables(KV)
    compiled = torch.compile(fn, fullgraph=True, dynamic=False, options={"triton.cudagraphs": False})
    with torch.inference_mode():
        compiled(torch.tensor([3, 4]), torch.tensor([9]), cache.k, cache.v, KV, True)
    return metrics.generated_kernel_count


def test_the_compiled_step_meets_its_kernel_budget_and_the_unfused_one_does_not(backbone):
    dm = backbone.dm
    budget = KERNELS_PER_LAYER * dm.spec.num_layers + KERNELS_OUTSIDE
    now = _kernels(dm.step, dm)
    old = _kernels(lambda *a: _unfused_step(dm, *a), dm)
    assert now <= budget < old, (now, budget, old)


def test_the_compiled_step_has_no_graph_break_and_no_host_sync(backbone):
    """fullgraph: one graph; in it, no operator that hands a value to Python (``.item()``, a
    data-dependent branch or shape), so a token costs no host synchronisation."""
    dm = backbone.dm
    cache = dm.new_cache(2, KV)
    dm.rope_tables(KV)
    args = (torch.tensor([3, 4]), torch.tensor([9]), cache.k, cache.v, KV, True)
    explained = torch._dynamo.explain(dm.step)(*args)
    assert explained.graph_break_count == 0
    assert explained.graph_count == 1
    syncing = {"item", "_local_scalar_dense", "nonzero", "tolist", "masked_select"}
    targets = {str(getattr(n.target, "__name__", n.target)) for g in explained.graphs for n in g.graph.nodes}
    assert not targets & syncing, targets & syncing


# ---- every mode (last: the compiled one reuses what the kernel budget compiled) ------------------


@pytest.mark.parametrize("mode", ["compiled", "graphs", "fused"])
def test_every_mode_draws_the_eager_tokens(backbone, monkeypatch, mode):
    if mode == "fused":
        pytest.importorskip("triton", reason="triton is not installed (pip install -r requirements-dev.txt)")
    monkeypatch.setattr(backbone, "bucket", KV)
    # batch 2 (the kernels' tests cover 1 to 4); compiled: the shape the kernel budget compiled
    # (inductor's cache serves it); fused: 3 frames, the interpreter runs ~30 kernels a step
    for seeds in ([5], [6, 7]) if mode == "graphs" else ([6, 7],):
        frames = 3 if mode == "fused" else 20
        eager = _run(backbone, seeds, frames)
        step = DecodeStep(backbone.dm, mode, backbone.gpt.arch.context_length)
        monkeypatch.setattr(backbone, "compiled", step)
        got = _run(backbone, seeds, frames)
        monkeypatch.setattr(backbone, "compiled", None)
        assert step.failed is None, step.describe()
        assert (len(seeds), KV) in step.graphs
        assert (step.sampler is not None) == (mode == "fused")
        for a, b in zip(eager, got, strict=True):
            assert torch.equal(a, b), (mode, seeds)


# ---- the worker's setting ------------------------------------------------------------------------


def test_a_worker_with_decode_mode_graphs_serves_through_its_captured_step(tiny_dir, tmp_path):
    """DECODE_MODE reaches the worker: /health says which step runs and what it prepared at load
    (batch 1 and MAX_BATCH at the first KV bucket), and a batch of takes is served through it."""
    import httpx

    from tests.support.http import TLS
    from tests.support.servers import start_worker

    w = start_worker(tmp_path, "--runtime-mode", "keep_loaded", env={"DECODE_MODE": "graphs"}, name="graphs")
    try:
        w.wait_healthy()
        step = httpx.get(w.url + "/health", timeout=10, verify=TLS).json()["decode_step"]
        assert step["mode"] == "graphs", step
        assert step["fallback"] is None, step
        assert {"1x256", "4x256"} <= set(step["graphs"]), step
        assert step["kv_rows"] == 4, step  # one persistent cache of MAX_BATCH rows, taken at load
        body = {"lyrics": "[verse]\nhello", "tags": "pop", "duration": 3 / 60, "job_id": "jg"}
        takes = [{**body, "seed_override": 80 + i, "task_id": f"g{i}", "track_index": i} for i in range(2)]
        r = httpx.post(w.url + "/generate_batch", json={"takes": takes}, timeout=120, verify=TLS)
        assert r.status_code == 200, r.text
        assert [x["status"] for x in r.json()["results"]] == ["ok", "ok"]
    finally:
        w.stop()
