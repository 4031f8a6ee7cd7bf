"""The decode engine: step == megatron's forward, no host sync per token, compile, batched takes."""

from __future__ import annotations

import dataclasses
import math
import uuid

import numpy as np
import pytest
import torch

from songserve.errors import TaskCancelled
from songserve.pipeline.checkpoints.gpt_load import load_model
from songserve.pipeline.context import TaskContext
from songserve.pipeline.engine.decode_step import DecodeStep
from songserve.pipeline.engine.gpt import AcousticGPT
from songserve.pipeline.engine.oracle import causal_mask, megatron_forward, new_kv_context
from songserve.pipeline.engine.sampling import sample
from songserve.pipeline.engine.transformer import DecodeModel
from songserve.pipeline.stages import tokenizer as tk
from songserve.pipeline.stages.backbone import Backbone, Take
from songserve.pipeline.stages.length import LengthPlan

PROMPT = list(range(3, 23))


@pytest.fixture(scope="module")
def backbone(tiny_dir, megatron_cpu):
    eod = tk.load_tokenizer(tiny_dir / "tokenizer").token_id(tk.EOD)
    return Backbone(load_model(tiny_dir / "backbone", megatron_cpu, torch.float32), eod)


def _megatron_hidden(model, ids: torch.Tensor) -> torch.Tensor:
    """Megatron's own forward (causal, explicit mask) → (S, H) for batch 1."""
    S = ids.shape[1]
    pos = torch.arange(S).view(1, -1)
    x = model.embedding(input_ids=ids, position_ids=pos)
    return model.decoder(hidden_states=x, attention_mask=causal_mask(S, torch.device("cpu")))[:, 0]


def _check_step_matches(dm: DecodeModel, ref: torch.Tensor, ids: torch.Tensor, split: int) -> None:
    S = ids.shape[1]
    with torch.inference_mode():
        one = dm.forward(dm.embed(ids, torch.arange(S).view(1, -1)))[0]
        assert torch.allclose(one, ref, atol=2e-5), (one - ref).abs().max()
        cache = dm.new_cache(1, S + 8)
        dm.forward(dm.embed(ids[:, :split], torch.arange(split).view(1, -1)), cache=cache)
        for p in range(split, S):
            for kv_len, masked in ((p + 1, False), (S + 8, True)):  # exact prefix, and a padded bucket
                h = dm.step(ids[:, p], torch.tensor([p]), cache.k, cache.v, kv_len, masked)
                assert torch.allclose(h[0], ref[p], atol=2e-5), (p, masked, (h[0] - ref[p]).abs().max())


def test_step_equals_megatron_forward_on_the_tiny_set(backbone):
    ids = torch.randint(0, backbone.gpt.arch.vocab_size, (1, 24))
    with torch.inference_mode():
        ref = _megatron_hidden(backbone.gpt.model, ids)
    _check_step_matches(backbone.dm, ref, ids, split=16)


def test_step_equals_megatron_forward_on_a_release_like_config(megatron_cpu, monkeypatch):
    """RMSNorm, SwiGLU, grouped-query attention, qkv biases, untied output, RoPE base 500000."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from songserve.pipeline.engine.attention import SdpaDotProductAttention

    # megatron moves RoPE's inv_freq to "the current CUDA device" (megatron-cpu.md, 4.): here, the CPU
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=8,
        num_query_groups=2,
        ffn_hidden_size=96,
        normalization="RMSNorm",
        layernorm_epsilon=1e-5,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=True,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        cuda_graph_scope=[],
    )
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = SdpaDotProductAttention
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=512,
        max_sequence_length=128,
        position_embedding_type="rope",
        rotary_base=500000,
        share_embeddings_and_output_weights=False,
    ).eval()
    with torch.no_grad():  # biases start at zero: make them matter
        for layer in model.decoder.layers:
            layer.self_attention.linear_qkv.bias.normal_()
    ids = torch.randint(0, 512, (1, 20))
    with torch.inference_mode():
        pos = torch.arange(20).view(1, -1)
        x = model.embedding(input_ids=ids, position_ids=pos)
        rope = model.rotary_pos_emb(20)
        ref = model.decoder(hidden_states=x, attention_mask=causal_mask(20, torch.device("cpu")), rotary_pos_emb=rope)
    dm = DecodeModel(model, model.output_layer.weight)
    assert (dm.spec.groups, dm.spec.normalization, dm.spec.gated, dm.spec.rope) == (2, "RMSNorm", True, True)
    _check_step_matches(dm, ref[:, 0], ids, split=12)


def _old_loop(backbone: Backbone, prompt: list[int], frames: int, seed: int, top_k: int = 50) -> torch.Tensor:
    """The per-token loop, kept as a reference (megatron's forward per token, a host sync per token)."""
    gpt, T = backbone.gpt, backbone.text_vocab
    gen = torch.Generator().manual_seed(seed)
    cache = new_kv_context(gpt, len(prompt) + 2 * frames)
    ids = torch.tensor(prompt).view(1, -1, 1)
    h = megatron_forward(gpt, ids, torch.arange(len(prompt)).view(1, -1), causal_mask(len(prompt), gpt.device), cache)[
        -1
    ]
    cache.increment_sequence_len_offset(len(prompt))
    codes = []
    for t in range(2 * frames):
        start = T + (t % 2) * 1024
        code = int(sample(gpt.project(h, start, start + 1024), top_k, gen)[0])
        codes.append(code)
        if t + 1 < 2 * frames:
            h = megatron_forward(gpt, torch.tensor([[[start + code]]]), torch.tensor([[len(prompt) + t]]), None, cache)[
                -1
            ]
            cache.increment_sequence_len_offset(1)
    return torch.tensor(codes).view(-1, 2).t()


def _takes(seeds: list[int]) -> list[Take]:
    return [Take(torch.Generator().manual_seed(s), TaskContext(f"take{s}")) for s in seeds]


def _run(backbone, seeds, frames=60, min_frames=None, **kw):
    plan = LengthPlan(frames, frames if min_frames is None else min_frames, 2 * frames)
    takes = _takes(seeds)
    with torch.inference_mode():
        out = backbone.generate_batch(PROMPT, plan, takes, top_k=kw.pop("top_k", 50), temperature=1.0, **kw)
    return out, takes


def test_new_loop_draws_the_same_tokens_as_the_old_one(backbone):
    with torch.inference_mode():
        old = _old_loop(backbone, PROMPT, 100, seed=11)
    new, _ = _run(backbone, [11], frames=100)
    assert torch.equal(new[0].codes, old)


_CONVERSIONS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")


def _count_conversions(fn) -> int:
    count = [0]
    originals = {name: getattr(torch.Tensor, name) for name in _CONVERSIONS}
    for name, real in originals.items():

        def counted(self, *a, _real=real, **k):
            count[0] += 1
            return _real(self, *a, **k)

        setattr(torch.Tensor, name, counted)
    try:
        fn()
    finally:
        for name, real in originals.items():
            setattr(torch.Tensor, name, real)
    return count[0]


def test_the_decode_loop_makes_no_host_sync_per_token(backbone, monkeypatch):
    """Tensor → Python conversions depend on the number of checks, not on the number of tokens."""
    monkeypatch.setattr(backbone, "check_every", 10_000)  # one check, at the end
    short = _count_conversions(lambda: _run(backbone, [1, 2], frames=20))
    long = _count_conversions(lambda: _run(backbone, [1, 2], frames=200))
    assert long == short, (short, long)
    # and the counter does see a conversion per token when there is one (the reference loop's int(...))
    with torch.inference_mode():
        assert _count_conversions(lambda: _old_loop(backbone, PROMPT, 20, seed=1)) >= 40


def test_compiled_step_has_no_graph_breaks_and_draws_the_eager_tokens(backbone, monkeypatch):
    dm = backbone.dm
    cache = dm.new_cache(2, 256)
    explained = torch._dynamo.explain(dm.step)(
        torch.zeros(2, dtype=torch.long), torch.tensor([20]), cache.k, cache.v, 256, True
    )
    assert explained.graph_break_count == 0
    assert explained.graph_count == 1
    eager, _ = _run(backbone, [5, 6], frames=40)
    # aot_eager: dynamo's full graph through AOT autograd, without inductor's C++ build (minutes
    # on these CPUs); the inductor path is exercised by bench P5 and gpu_check.sh
    compiled = DecodeStep(dm, "compiled", backbone.gpt.arch.context_length, backend="aot_eager")
    monkeypatch.setattr(backbone, "compiled", compiled)
    monkeypatch.setattr(backbone, "bucket", 64)
    got, _ = _run(backbone, [5, 6], frames=40)
    assert compiled.failed is None
    assert compiled.graphs
    assert all(n >= 64 for _, n in compiled.graphs)
    for a, b in zip(eager, got, strict=True):
        assert torch.equal(a.codes, b.codes)


@pytest.mark.parametrize("n", [2, 4])
def test_a_take_in_a_batch_draws_what_it_draws_alone(backbone, n):
    seeds = [21 + i for i in range(n)]
    batch, btakes = _run(backbone, seeds)
    for i, s in enumerate(seeds):
        alone, atakes = _run(backbone, [s])
        assert torch.equal(batch[i].codes, alone[0].codes)
        assert torch.equal(btakes[i].generator.get_state(), atakes[0].generator.get_state())


def test_the_weight_major_matmul_keeps_a_take_in_a_batch_equal_to_it_alone(backbone, monkeypatch):
    """The tiny set's weights are below LARGE_WEIGHT: lower it so batches of 2-4 take the w @ x.T path."""
    from songserve.pipeline.engine import transformer

    calls = []
    real_mm, real_addmm = torch.mm, torch.addmm
    monkeypatch.setattr(transformer, "LARGE_WEIGHT", 0)
    monkeypatch.setattr(torch, "mm", lambda a, b: calls.append(b.shape) or real_mm(a, b))
    monkeypatch.setattr(torch, "addmm", lambda c, a, b: calls.append(b.shape) or real_addmm(c, a, b))
    seeds = [21, 22, 23]
    batch, btakes = _run(backbone, seeds, frames=40)
    assert calls
    assert all(shape[1] == 3 for shape in calls)
    calls.clear()
    for i, s in enumerate(seeds):
        alone, atakes = _run(backbone, [s], frames=40)
        assert torch.equal(batch[i].codes, alone[0].codes)
        assert torch.equal(btakes[i].generator.get_state(), atakes[0].generator.get_state())
    assert calls
    assert all(shape[1] == 2 for shape in calls)  # one row padded to two: the same gemm kernel


def test_step_linear_equals_f_linear_for_every_row_count():
    import torch.nn.functional as F

    from songserve.pipeline.engine.transformer import step_linear

    w, b = torch.randn(768, 512), torch.randn(768)
    for rows in (1, 2, 3, 4, 5, 9):
        x = torch.randn(rows, 1, 512)
        for bias in (None, b):
            got = step_linear(x, w, bias)
            assert got.shape == (rows, 1, 768)
            assert got.is_contiguous()
            assert torch.allclose(got, F.linear(x, w, bias), atol=1e-4), (rows, bias is None)
    # weight-major, a row of a batch of 2 or 3 is bitwise what it is alone (the same gemm kernel)
    x = torch.randn(3, 1, 512)
    alone = [step_linear(x[i : i + 1], w, b) for i in range(3)]
    for rows in (2, 3):
        got = step_linear(x[:rows], w, b)
        assert all(torch.equal(got[i : i + 1], alone[i]) for i in range(rows)), rows


@pytest.mark.parametrize("top_p", [None, 0.8])
def test_draw_equals_torch_multinomial(top_p):
    """sample / sample_rows are multinomial's one-sample rule written out: same index, same generator state."""
    from songserve.pipeline.engine.sampling import _filtered, sample_rows

    for trial in range(40):
        k = (1, 7, 50, 300)[trial % 4]
        logits = torch.randn(3, 1024) * 4
        gens = [torch.Generator().manual_seed(100 * trial + r) for r in range(3)]
        refs = [torch.Generator().manual_seed(100 * trial + r) for r in range(3)]
        probs, idx = _filtered(logits, k, 0.9, top_p)
        want = torch.stack(
            [idx[r, torch.multinomial(probs[r : r + 1], 1, generator=g)[0, 0]] for r, g in enumerate(refs)]
        )
        assert torch.equal(sample_rows(logits, k, gens, 0.9, top_p), want)
        for g, ref in zip(gens, refs, strict=True):
            assert torch.equal(g.get_state(), ref.get_state())
        one, ref = torch.Generator().manual_seed(trial), torch.Generator().manual_seed(trial)
        got = sample(logits, k, one, 0.9, top_p)  # one generator for the whole batch (superres's way)
        assert torch.equal(got, idx.gather(-1, torch.multinomial(probs, 1, generator=ref)).squeeze(-1))
        assert torch.equal(one.get_state(), ref.get_state())


def _competitive_eod(backbone, monkeypatch, share: float = 0.02):
    """End-of-document given ``share`` of the window's mass (more after top-k): each row ends at its own frame."""
    gpt, real = backbone.gpt, backbone.gpt.project
    state = {"last": None}

    def project(hidden, start, stop):
        logits = real(hidden, start, stop)
        if (start, stop) == (backbone.eod_id, backbone.eod_id + 1):
            return state["last"].logsumexp(-1, keepdim=True) + math.log(share / (1 - share))
        state["last"] = logits
        return logits

    monkeypatch.setattr(gpt, "project", project)


def test_rows_end_at_different_frames_and_each_equals_its_take_alone(backbone, monkeypatch):
    _competitive_eod(backbone, monkeypatch)
    seeds = [31, 32, 33, 34]
    batch, btakes = _run(backbone, seeds, frames=200, min_frames=2)
    lengths = [r.codes.shape[1] for r in batch]
    assert all(r.stopped_by == "end_of_audio" for r in batch), lengths
    assert len(set(lengths)) > 1, lengths
    for i, s in enumerate(seeds):
        alone, atakes = _run(backbone, [s], frames=200, min_frames=2)
        assert torch.equal(batch[i].codes, alone[0].codes)
        # the generator is where it would be alone: superres draws the same
        assert torch.equal(btakes[i].generator.get_state(), atakes[0].generator.get_state())


class _CountingBackend:
    """A torch.compile backend that runs the captured graph as is and counts compilations."""

    def __init__(self) -> None:
        self.compiles = 0

    def __call__(self, gm, example_inputs):
        self.compiles += 1
        return gm.forward


def _compiled(backbone, monkeypatch, bucket: int) -> tuple[DecodeStep, _CountingBackend, list[int]]:
    """The backbone with a compiled step (counting backend); returns the step, its backend, the batch of each call."""
    torch._dynamo.reset()  # no graph of another test's backend is reused
    counter = _CountingBackend()
    step = DecodeStep(backbone.dm, "compiled", backbone.gpt.arch.context_length, backend=counter)
    batches: list[int] = []
    real_call = DecodeStep.__call__
    monkeypatch.setattr(
        DecodeStep, "__call__", lambda self, tok, *a: batches.append(tok.shape[0]) or real_call(self, tok, *a)
    )
    monkeypatch.setattr(backbone, "compiled", step)
    monkeypatch.setattr(backbone, "bucket", bucket)
    return step, counter, batches


def test_the_compiled_step_compiles_once_per_shape_whatever_the_requests_length(backbone, monkeypatch):
    step, counter, _ = _compiled(backbone, monkeypatch, bucket=128)
    step.warm([2], [128], backbone.gpt.arch.context_length)
    assert counter.compiles == 1
    for frames in (20, 30, 45):  # three request lengths, one KV bucket
        _run(backbone, [5, 6], frames=frames)
    assert counter.compiles == 1  # warmed at load, reused by every request (a cache per length recompiled)
    assert step.graphs == {(2, 128)}


@pytest.mark.parametrize("warm", [[1, 2, 3, 4], [4]])
def test_the_compiled_step_drops_finished_rows_when_the_smaller_batch_is_compiled(backbone, monkeypatch, warm):
    _competitive_eod(backbone, monkeypatch, share=0.003)  # rows end tens of frames apart (21-108)
    seeds = [31, 32, 33, 34]
    eager = [_run(backbone, [s], frames=200, min_frames=2)[0][0] for s in seeds]
    step, counter, batches = _compiled(backbone, monkeypatch, bucket=512)  # P + 400 tokens: one bucket
    step.warm(warm, [512], backbone.gpt.arch.context_length)
    batches.clear()
    got, _ = _run(backbone, seeds, frames=200, min_frames=2)
    assert step.failed is None
    assert counter.compiles == len(warm)  # nothing compiled mid-song
    for a, b in zip(eager, got, strict=True):
        assert torch.equal(a.codes, b.codes)
    assert batches == sorted(batches, reverse=True)
    if warm == [4]:
        assert set(batches) == {4}  # no graph for a smaller batch: the finished rows ride along
    else:
        assert batches[0] == 4
        assert set(batches) == {4, 3, 2, 1}  # each row that ended stopped costing (rows end at 21, 37, 55, 108)


def test_cancelling_one_take_leaves_the_others_untouched(backbone, monkeypatch):
    takes = _takes([41, 42, 43])
    real_report = takes[1].ctx.report
    seen = []

    def report(phase, done, total, detail="", rate=None):
        seen.append(done)
        real_report(phase, done, total, detail, rate)
        if done >= 32:
            takes[1].ctx.cancel()

    monkeypatch.setattr(takes[1].ctx, "report", report)
    plan = LengthPlan(60, 60, 120)
    with torch.inference_mode():
        out = backbone.generate_batch(PROMPT, plan, takes, top_k=50, temperature=1.0)
    assert out[1] is None
    assert max(seen) < 120
    for i in (0, 2):
        alone, _ = _run(backbone, [41 + i])
        assert torch.equal(out[i].codes, alone[0].codes)


def test_chunked_prefill_equals_one_pass(backbone, monkeypatch):
    prompt = list(range(3, 203))
    results = []
    for chunk in (1000, 64, 7):
        monkeypatch.setattr(backbone, "prefill_chunk", chunk)
        cache = backbone.dm.new_cache(2, 256)
        with torch.inference_mode():
            h = backbone.prefill(prompt, cache, [TaskContext("p")])
        results.append((h, torch.stack([t[:, :, :200] for t in cache.k])))
    for h, k in results[1:]:
        assert torch.allclose(h, results[0][0], atol=1e-5)
        assert torch.allclose(k, results[0][1], atol=1e-5)
    assert torch.equal(results[0][1][:, 0], results[0][1][:, 1])  # the prompt's KV copied to each row


def test_a_cancel_during_a_long_prefill_lands_within_one_chunk(backbone, monkeypatch):
    monkeypatch.setattr(backbone, "prefill_chunk", 16)
    ctx = TaskContext("long")
    calls = []
    real = backbone.dm.forward

    def forward(*a, **k):
        calls.append(1)
        ctx.cancel()  # the cancel arrives while the first chunk runs
        return real(*a, **k)

    monkeypatch.setattr(backbone.dm, "forward", forward)
    with pytest.raises(TaskCancelled), torch.inference_mode():
        backbone.generate(list(range(3, 803)), 10, top_k=50, temperature=1.0, generator=torch.Generator(), ctx=ctx)
    assert len(calls) == 1  # 50 chunks in the prompt; the one running finished, no other started


def test_kv_bytes_per_take(backbone):
    dm = backbone.dm
    s = dm.spec
    assert dm.kv_bytes_per_take(1000) == 2 * s.num_layers * s.groups * s.head_dim * 1000 * 4
    assert isinstance(backbone.gpt, AcousticGPT)
    assert math.isfinite(dm.spec.scale)


def test_kv_memory_a_batch_newly_takes_in_each_mode(backbone, monkeypatch):
    """What the worker's split-don't-OOM check counts: eager, the request's length; the compiled
    step, the full context; CUDA graphs, nothing where their persistent cache holds the rows."""
    dm, ctx = backbone.dm, backbone.gpt.arch.context_length
    assert backbone.kv_bytes_new(2, 100) == 2 * dm.kv_bytes_per_take(100)
    monkeypatch.setattr(backbone, "compiled", DecodeStep(dm, "compiled", ctx))  # built, not compiled: nothing runs
    assert backbone.kv_bytes_new(2, 100) == 2 * dm.kv_bytes_per_take(ctx)
    graphs = DecodeStep(dm, "graphs", ctx)  # on the CPU only its cache bookkeeping is exercised (no capture)
    monkeypatch.setattr(backbone, "compiled", graphs)
    assert backbone.kv_bytes_new(2, 100) == 2 * dm.kv_bytes_per_take(ctx)
    two = graphs.cache_for(2, 100)
    assert backbone.kv_bytes_new(2, 100) == 0
    assert backbone.kv_bytes_new(4, 100) == 4 * dm.kv_bytes_per_take(ctx)  # a wider batch regrows it
    four = graphs.cache_for(4, 100)
    assert graphs.describe()["kv_rows"] == 4
    one, two_again = graphs.cache_for(1, 100), graphs.cache_for(2, 100)
    for c, rows in ((one, 1), (two_again, 2), (four, 4)):  # every batch size: the first rows of one cache
        assert c.batch == rows
        assert c.k[0].is_contiguous()
        assert c.k[0].data_ptr() == four.k[0].data_ptr()
    assert two.k[0].data_ptr() != four.k[0].data_ptr()  # the regrow replaced the old cache
    assert backbone.kv_bytes_new(3, 100) == 0
    assert backbone.kv_bytes_new(2, ctx + 1) == 2 * dm.kv_bytes_per_take(ctx + 1)  # past the graphs: eager


# ---- super-resolution batched --------------------------------------------------------------------


@pytest.fixture(scope="module")
def superres(tiny_dir, megatron_cpu):
    from songserve.pipeline.stages.superres import SuperRes

    return SuperRes(load_model(tiny_dir / "superres", megatron_cpu, torch.float32))


def test_superres_forward_equals_megatron_with_its_all_visible_mask(superres):
    from songserve.pipeline.engine.oracle import full_mask

    gpt, dm = superres.gpt, superres.dm
    grid = torch.randint(0, gpt.arch.vocab_size, (1, 30, 64))
    grid[:, :12, 1:] = -1
    pos = torch.arange(30).view(1, -1)
    with torch.inference_mode():
        ref = megatron_forward(gpt, grid, pos, full_mask(30, gpt.device))[:, 0]
        got = dm.forward(dm.embed(grid, pos), causal=False)[0]
    assert torch.allclose(got, ref, atol=2e-5), (got - ref).abs().max()


def test_superres_batch_of_different_lengths_equals_each_take_alone(superres, backbone):
    coarse = [_run(backbone, [s], frames=f)[0][0].codes for s, f in ((51, 30), (52, 18), (53, 30))]
    prompt = list(range(3, 15))
    gens = [torch.Generator().manual_seed(60 + i) for i in range(3)]
    ctxs = [TaskContext(f"sr{i}") for i in range(3)]
    batch = superres.generate_batch(prompt, coarse, top_k=10, generators=gens, ctxs=ctxs)
    for i, c in enumerate(coarse):
        alone = superres.generate(prompt, c, top_k=10, generator=torch.Generator().manual_seed(60 + i), ctx=ctxs[i])
        assert batch[i].shape == (64, c.shape[1])
        # padded rows go through a masked softmax: equal to float rounding, and the draws are identical
        assert torch.equal(batch[i], alone), (i, (batch[i] == alone).float().mean().item())
    assert all(x.snapshot().done == 62 for x in ctxs)


# ---- the worker: POST /generate_batch, park ------------------------------------------------------


@pytest.fixture(scope="module")
def worker(shared_tiny):
    from tests.support.tiny_site import lent

    with lent(shared_tiny) as w:  # the process's tiny-model worker: keep_loaded (tests/support/tiny_site.py)
        yield w


RUN = uuid.uuid4().hex[:8]  # a worker runs a task id once: this file's ids are its own on the shared worker


def tid(name: str) -> str:
    return f"{name}-{RUN}"


def _body(seed: int, task_id: str, **kw) -> dict:
    body = {"lyrics": "[verse]\nhello world", "tags": "pop, piano", "duration": 3 / 60}
    return {**body, "seed_override": seed, "task_id": tid(task_id), "job_id": "jb", "track_index": seed % 4, **kw}


def _samples(w, name: str):
    import io

    import httpx
    import soundfile as sf

    from tests.support.http import TLS

    r = httpx.get(f"{w.url}/download/{name}", timeout=30, verify=TLS)
    assert r.status_code == 200
    return sf.read(io.BytesIO(r.content))[0]


def test_generate_batch_through_a_real_worker_equals_each_take_alone(worker):
    import httpx
    import numpy as np

    from tests.support.http import TLS

    cfg = httpx.get(worker.url + "/config", timeout=10, verify=TLS).json()
    assert cfg["max_batch"] == 4
    assert cfg["kv_bytes_per_take"] > 0
    takes = [_body(70 + i, f"b{i}") for i in range(2)]
    r = httpx.post(worker.url + "/generate_batch", json={"takes": takes}, timeout=120, verify=TLS)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["task_id"] for x in results] == [tid("b0"), tid("b1")]
    assert all(x["status"] == "ok" for x in results)
    meta = results[1]["metadata"]
    assert meta["batch_size"] == 2
    assert meta["timings"]["backbone_sec"] > 0
    assert meta["stopped_by"] == "budget"
    alone = httpx.post(worker.url + "/generate", json=_body(71, "a1"), timeout=120, verify=TLS).json()
    assert alone["status"] == "ok"
    assert alone["metadata"]["batch_size"] == 1
    assert np.array_equal(_samples(worker, results[1]["wav_filename"]), _samples(worker, alone["wav_filename"]))
    assert not np.array_equal(_samples(worker, results[0]["wav_filename"]), _samples(worker, alone["wav_filename"]))


def test_generate_batch_refuses_takes_of_different_requests(worker):
    import httpx

    from tests.support.http import TLS

    takes = [_body(1, "d0"), _body(2, "d1", tags="rock")]
    r = httpx.post(worker.url + "/generate_batch", json={"takes": takes}, timeout=60, verify=TLS)
    assert r.status_code == 400
    assert "differ only in seed" in r.json()["error"]


def test_cancelling_one_take_of_a_batch_over_http(worker):
    import concurrent.futures as cf

    import httpx

    from tests.support.http import TLS
    from tests.support.servers import wait_for

    takes = [_body(80 + i, f"c{i}", duration=1.0) for i in range(2)]
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(httpx.post, worker.url + "/generate_batch", json={"takes": takes}, timeout=180)

        def both_running():
            # a cancel in the backbone or superres lands before c1 is decoded (the tiny backbone of
            # a 1-minute batch of 2 takes ~0.6 s: polling for that phase alone could miss it)
            h = httpx.get(worker.url + "/health", timeout=5, verify=TLS).json()
            tasks = {t["task_id"]: t for t in h.get("tasks", [])}
            return len(tasks) == 2 and tasks[tid("c1")]["phase"] in ("backbone", "superres")

        wait_for(both_running, timeout=60, interval=0.02)
        c = httpx.post(f"{worker.url}/cancel/{tid('c1')}", timeout=10, verify=TLS)
        assert c.status_code == 200
        r = fut.result()
    results = r.json()["results"]
    assert results[0]["status"] == "ok"
    assert results[1]["status"] == "cancelled"
    assert results[0]["metadata"]["tokens"]["frames"] == int(1.0 * 60 * 44100 / 2048)
    assert httpx.get(f"{worker.url}/tasks/{tid('c1')}", timeout=5, verify=TLS).json()["status"] == "cancelled"


def test_park_mode_outputs_equal_keep_loaded_and_health_shows_what_is_parked(worker, tmp_path):
    import httpx
    import numpy as np

    from tests.support.http import TLS
    from tests.support.servers import start_worker

    w = start_worker(tmp_path, "--runtime-mode", "park", "--park-backbone", "1", name="park")
    try:
        w.wait_healthy()
        h = httpx.get(w.url + "/health", timeout=10, verify=TLS).json()
        assert h["runtime_mode"] == "park"
        assert h["park_backbone"] == "1"
        assert h["parked"] == ["decoder", "encoder", "superres"]  # the encoder (uploads) waits too
        parked = httpx.post(w.url + "/generate", json=_body(90, "p0"), timeout=120, verify=TLS).json()
        assert parked["status"] == "ok"
        # the state each stage ran in: the backbone waited in host memory during superres and decoder
        assert parked["metadata"]["parked"] == {
            "backbone": ["decoder", "encoder", "superres"],
            "superres": ["backbone", "decoder", "encoder"],
            "decoder": ["backbone", "encoder", "superres"],
        }
        assert httpx.get(w.url + "/health", timeout=10, verify=TLS).json()["parked"] == [
            "decoder",
            "encoder",
            "superres",
        ]
        kept = httpx.post(worker.url + "/generate", json=_body(90, "k0"), timeout=120, verify=TLS).json()
        assert "parked" not in kept["metadata"]
        assert np.array_equal(_samples(w, parked["wav_filename"]), _samples(worker, kept["wav_filename"]))
    finally:
        w.stop()


def test_park_state_machine_unparks_each_stage_only_for_its_stage(tiny_dir, megatron_cpu, tmp_path, monkeypatch):
    from songserve.pipeline.checkpoints.layout import resolve
    from songserve.pipeline.pipeline import ModelPipeline
    from songserve.pipeline.types import TrackRequest
    from songserve.worker.settings import WorkerSettings

    pipe = ModelPipeline(
        WorkerSettings(output_dir=tmp_path, runtime_mode="park"), resolve(WorkerSettings()), megatron_cpu
    )
    pipe.load()
    assert pipe.residency.parked == {"superres", "decoder", "encoder"}  # the encoder only moves for an upload
    seen = {}
    sr = next(iter(pipe.residency.superres.values()))
    real_sr, real_dec = sr.generate_batch, pipe.residency.decoder.decode

    def spy_sr(*a, **k):
        seen["superres"] = set(pipe.residency.parked)
        return real_sr(*a, **k)

    def spy_dec(*a, **k):
        seen["decoder"] = set(pipe.residency.parked)
        return real_dec(*a, **k)

    monkeypatch.setattr(sr, "generate_batch", spy_sr)
    monkeypatch.setattr(pipe.residency.decoder, "decode", spy_dec)
    pipe.run(TrackRequest(lyrics="la", tags="pop", duration=2 / 60, seed=1, task_id="pk"), TaskContext("pk"))
    # PARK_BACKBONE=auto: never on the CPU
    assert seen == {"superres": {"decoder", "encoder"}, "decoder": {"superres", "encoder"}}
    assert pipe.residency.parked == {"superres", "decoder", "encoder"}


def _park_pipe(tmp_path, megatron_cpu, **kw):
    from songserve.pipeline.checkpoints.layout import resolve
    from songserve.pipeline.pipeline import ModelPipeline
    from songserve.worker.settings import WorkerSettings

    pipe = ModelPipeline(WorkerSettings(output_dir=tmp_path, **kw), resolve(WorkerSettings()), megatron_cpu)
    pipe.load()
    return pipe


def test_park_backbone_state_sequence_and_outputs_equal_keep_loaded(tiny_dir, megatron_cpu, tmp_path, monkeypatch):
    import soundfile as sf

    from songserve.pipeline.types import TrackRequest

    pipe = _park_pipe(tmp_path / "park", megatron_cpu, runtime_mode="park", park_backbone="1")
    assert pipe.loaded()["park_backbone"] == "1"
    states = []
    bb, sr = next(iter(pipe.residency.backbones.values())), next(iter(pipe.residency.superres.values()))
    for stage, obj, name in (("backbone", bb, "generate_batch"), ("superres", sr, "generate_batch")):
        real = getattr(obj, name)
        monkeypatch.setattr(
            obj, name, lambda *a, _r=real, _s=stage, **k: states.append((_s, set(pipe.residency.parked))) or _r(*a, **k)
        )
    real_dec = pipe.residency.decoder.decode
    monkeypatch.setattr(
        pipe.residency.decoder,
        "decode",
        lambda *a, **k: states.append(("decoder", set(pipe.residency.parked))) or real_dec(*a, **k),
    )
    reqs = [TrackRequest(lyrics="la", tags="pop", duration=2 / 60, seed=s, task_id=f"pb{s}") for s in (1, 2)]
    got = pipe.run_batch(reqs, [TaskContext(r.task_id) for r in reqs])
    assert states == [  # the encoder waits in host memory throughout (it moves only for an upload)
        ("backbone", {"superres", "decoder", "encoder"}),
        ("superres", {"backbone", "decoder", "encoder"}),
        ("decoder", {"backbone", "superres", "encoder"}),
        ("decoder", {"backbone", "superres", "encoder"}),  # one decode per take
    ]
    assert pipe.residency.parked == {"superres", "decoder", "encoder"}  # idle's state: the backbone resident again
    assert got[0].metadata["parked"]["superres"] == ["backbone", "decoder", "encoder"]

    kept = _park_pipe(tmp_path / "kept", megatron_cpu, runtime_mode="keep_loaded")
    want = kept.run_batch(
        [dataclasses.replace(r, task_id=r.task_id + "k") for r in reqs], [TaskContext(r.task_id + "k") for r in reqs]
    )
    for a, b in zip(got, want, strict=True):
        assert np.array_equal(
            sf.read(tmp_path / "park" / a.wav_filename)[0], sf.read(tmp_path / "kept" / b.wav_filename)[0]
        )
        assert a.metadata["tokens"] == b.metadata["tokens"]
    # a failure mid-stage still ends in idle's state (the backbone resident, the stages parked)
    monkeypatch.setattr(sr, "generate_batch", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        pipe.run(dataclasses.replace(reqs[0], task_id="pbx"), TaskContext("pbx"))
    assert pipe.residency.parked == {"superres", "decoder", "encoder"}


def test_park_backbone_refuses_other_modes_and_auto_parks_when_memory_is_short(
    tiny_dir, megatron_cpu, tmp_path, monkeypatch
):
    from songserve.errors import ConfigError

    with pytest.raises(ConfigError, match="PARK_BACKBONE=1 .* RUNTIME_MODE is keep_loaded"):
        _park_pipe(tmp_path, megatron_cpu, runtime_mode="keep_loaded", park_backbone="1")
    pipe = _park_pipe(tmp_path, megatron_cpu, runtime_mode="park")
    sr = next(iter(pipe.residency.superres.values()))
    assert not pipe.residency.backbone_must_park(sr, 2, 300)  # auto on the CPU: host memory is the device's
    need = pipe.residency.stage2_need(sr, 2, 300)
    weights = sum(
        p.numel() * p.element_size() for p in [*sr.gpt.model.parameters(), *pipe.residency.decoder.parameters()]
    )
    assert need > weights
    assert pipe.residency.stage2_need(sr, 4, 300) > need  # more takes, more activations
    # auto on CUDA, with the device's numbers stubbed: park exactly when free memory is short
    monkeypatch.setattr(pipe.residency, "device", torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: 0)
    for free, parks in ((need - 1, True), (need, False)):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d, _f=free: (_f, 10 * need))
        assert pipe.residency.backbone_must_park(sr, 2, 300) is parks


def test_a_tone_worker_serves_generate_batch_one_take_after_another(tmp_path):
    """Scheduling tests run against tone workers: the batch endpoint works there too."""
    import httpx

    from tests.support.http import TLS
    from tests.support.servers import start_worker

    w = start_worker(tmp_path, "--pipeline", "test", "--max-batch", "3", name="tone")
    try:
        w.wait_healthy()
        assert httpx.get(w.url + "/config", timeout=10, verify=TLS).json()["max_batch"] == 3
        takes = [_body(i, f"tone{i}") for i in range(3)]
        r = httpx.post(w.url + "/generate_batch", json={"takes": takes}, timeout=60, verify=TLS)
        assert r.status_code == 200, r.text
        assert [x["status"] for x in r.json()["results"]] == ["ok"] * 3
        assert [x["seed"] for x in r.json()["results"]] == [1283, 1, 2]  # seed_override 0 = the worker's own
        assert httpx.get(w.url + "/health", timeout=10, verify=TLS).json()["tasks_done"] == 3
    finally:
        w.stop()


def test_a_batch_that_does_not_fit_memory_is_split_not_run_out_of_memory(tiny_dir, megatron_cpu, tmp_path, monkeypatch):
    import dataclasses

    from songserve.pipeline import pipeline as pl
    from songserve.pipeline.checkpoints.layout import resolve
    from songserve.pipeline.types import TrackRequest
    from songserve.worker.settings import WorkerSettings

    s = WorkerSettings(output_dir=tmp_path, runtime_mode="keep_loaded", max_batch=4)
    pipe = pl.ModelPipeline(s, resolve(s), megatron_cpu)
    pipe.load()
    req = TrackRequest(lyrics="la", tags="pop", duration=2 / 60, seed=0)
    reqs = [dataclasses.replace(req, seed=i, task_id=f"m{i}") for i in range(3)]
    monkeypatch.setattr(pl, "mem_available", lambda: 10**12)
    together = pipe.run_batch(reqs, [TaskContext(r.task_id + "b") for r in reqs])
    assert [r.metadata["batch_size"] for r in together] == [3, 3, 3]
    tokens = together[0].metadata["tokens"]
    per_take = next(iter(pipe.residency.backbones.values())).dm.kv_bytes_per_take(tokens["backbone_prompt"] + 2 * 43)
    monkeypatch.setattr(pl, "mem_available", lambda: int(per_take * 2.4 / 0.8))  # room for two takes' KV
    out = pipe.run_batch(reqs, [TaskContext(r.task_id) for r in reqs])
    assert [r.metadata["batch_size"] for r in out] == [2, 2, 1]
    for a, b in zip(out, together, strict=True):  # splitting changes no take's audio
        assert a.metadata["tokens"] == b.metadata["tokens"]
        import soundfile as sf

        assert (sf.read(tmp_path / a.wav_filename)[0] == sf.read(tmp_path / b.wav_filename)[0]).all()
