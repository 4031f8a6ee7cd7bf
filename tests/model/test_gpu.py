"""Checks that need CUDA (run by bench/gpu_check.sh on a GPU machine; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

from songserve.pipeline.checkpoints.gpt_load import load_model
from songserve.pipeline.context import TaskContext
from songserve.pipeline.engine.decode_step import DecodeStep
from songserve.pipeline.engine.oracle import causal_mask, megatron_forward
from songserve.pipeline.engine.transformer import DecodeModel
from songserve.pipeline.stages.backbone import Backbone, Take
from songserve.pipeline.stages.length import LengthPlan

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
PROMPT = list(range(3, 23))


@pytest.fixture(scope="module")
def cuda():
    from songserve.pipeline.checkpoints.megatron_env import init_megatron

    init_megatron(torch.device("cuda", 0), 0, seed=0)
    return torch.device("cuda", 0)


def _backbone(tiny_dir, device, dtype):
    from songserve.pipeline.stages import tokenizer as tk

    eod = tk.load_tokenizer(tiny_dir / "tokenizer").token_id(tk.EOD)
    return Backbone(load_model(tiny_dir / "backbone", device, dtype), eod)


def _run(bb, seeds, frames=100, device="cuda"):
    takes = [Take(torch.Generator(device=device).manual_seed(s), TaskContext(str(s))) for s in seeds]
    with torch.inference_mode():
        return bb.generate_batch(PROMPT, LengthPlan(frames, frames, 2 * frames), takes, top_k=50, temperature=1.0)


def test_bf16_step_matches_megatron_forward(tiny_dir, cuda):
    bb = _backbone(tiny_dir, cuda, torch.bfloat16)
    dm: DecodeModel = bb.dm
    ids = torch.randint(0, bb.gpt.arch.vocab_size, (1, 24), device=cuda)
    with torch.inference_mode():
        pos = torch.arange(24, device=cuda).view(1, -1)
        ref = megatron_forward(bb.gpt, ids.unsqueeze(-1), pos, causal_mask(24, cuda))[:, 0].float()
        got = dm.forward(dm.embed(ids, pos))[0].float()
    assert (got - ref).abs().max().item() < 0.1  # bf16 rounding


def test_graphs_capture_and_draw_the_eager_tokens_in_fp32(tiny_dir, cuda):
    bb = _backbone(tiny_dir, cuda, torch.float32)
    eager = _run(bb, [1, 2])
    step = DecodeStep(bb.dm, "graphs", bb.gpt.arch.max_sequence_length)
    bb.compiled = step
    got = _run(bb, [1, 2])
    assert step.failed is None, step.describe()
    assert step.graphs, step.describe()
    same = [(a.codes == b.codes).float().mean().item() for a, b in zip(eager, got, strict=True)]
    assert min(same) > 0.9, same  # same distribution; TF32/kernel choice may flip a late draw


def test_no_host_sync_inside_the_decode_loop(tiny_dir, cuda):
    bb = _backbone(tiny_dir, cuda, torch.bfloat16)
    bb.compiled = DecodeStep(bb.dm, "graphs", bb.gpt.arch.max_sequence_length)
    _run(bb, [1], frames=20)  # capture first
    bb.check_every = 10_000  # one sync, at the end
    torch.cuda.set_sync_debug_mode("warn")
    import warnings

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _run(bb, [1, 2], frames=200)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) < 20, [str(w.message) for w in syncs[:5]]  # a handful at set-up and the final check, not 400


def _release_family(device) -> Backbone:
    """RMSNorm, SwiGLU, grouped-query attention, RoPE at tiny widths (what the fused step covers)."""
    from songserve.pipeline.engine.gpt import AcousticGPT, build_model
    from songserve.pipeline.tiny.build import release_arch

    torch.manual_seed(0)
    arch = release_arch("backbone", 256)
    return Backbone(AcousticGPT(arch, build_model(arch, device, torch.float32)), 1)


def _syncs(fn) -> int:
    import warnings

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


@pytest.mark.parametrize("mode", ["compiled", "graphs", "fused"])
def test_each_mode_captures_draws_the_eager_tokens_and_syncs_no_more_per_token(cuda, mode):
    """Every decode mode on a GPU: compiled (inductor under the step's own capture), graphs, fused (Triton,
    captured) against eager in fp32; the host syncs of 300 tokens are those of 30 (one per check)."""
    bb = _release_family(cuda)
    bb.bucket = 256
    eager = _run(bb, [1, 2], frames=40)
    step = DecodeStep(bb.dm, mode, bb.gpt.arch.context_length)
    step.warm([2], [256], bb.gpt.arch.context_length)
    bb.compiled = step
    got = _run(bb, [1, 2], frames=40)
    assert step.failed is None, step.describe()
    assert step.capture
    same = [(a.codes == b.codes).float().mean().item() for a, b in zip(eager, got, strict=True)]
    assert min(same) > 0.9, same  # TF32 / kernel choice may flip a late draw
    bb.check_every = 10_000  # one check, at the end
    short, long = _syncs(lambda: _run(bb, [1, 2], frames=15)), _syncs(lambda: _run(bb, [1, 2], frames=150))
    assert long <= short + 2, (short, long)


def test_park_moves_stages_to_pinned_host_memory_and_back(tiny_dir, cuda, tmp_path):
    from songserve.pipeline.checkpoints.layout import resolve
    from songserve.pipeline.pipeline import ModelPipeline
    from songserve.pipeline.types import TrackRequest
    from songserve.worker.settings import WorkerSettings

    s = WorkerSettings(output_dir=tmp_path, runtime_mode="park", device="cuda")
    pipe = ModelPipeline(s, resolve(s), cuda)
    pipe.load()
    p = next(next(iter(pipe.residency.superres.values())).gpt.model.parameters())
    assert p.device.type == "cpu"
    assert p.is_pinned()
    assert pipe.loaded()["parked"] == ["decoder", "superres"]
    before = torch.cuda.memory_allocated()
    r = pipe.run(TrackRequest(lyrics="la", tags="pop", duration=3 / 60, seed=1, task_id="park"), TaskContext("park"))
    assert r.duration_sec > 0
    assert pipe.loaded()["parked"] == ["decoder", "superres"]
    assert torch.cuda.memory_allocated() <= before + 64 * 2**20


def test_real_worker_and_dispatcher_on_cuda_serve_a_packed_job(tiny_dir, tmp_path):
    """The production path on a GPU, through real processes and HTTP: a worker in park mode with
    CUDA graphs warmed at load, and a dispatcher that packs a 2-track job onto it as one batch."""
    import io

    import httpx
    import soundfile as sf

    from tests.support.http import TLS
    from tests.support.servers import cluster_of, start_worker

    w = start_worker(tmp_path, "--runtime-mode", "park", name="gpu")
    try:
        h = w.wait_healthy(timeout=300)
        assert h["device"].startswith("cuda"), h
        assert h["parked"] == ["decoder", "superres"], h
        assert h["decode_step"]["cuda_graphs"] is True, h["decode_step"]
        assert h["decode_step"]["graphs"], h["decode_step"]
        cfg = httpx.get(w.url + "/config", timeout=10, verify=TLS).json()
        assert cfg["max_batch"] >= 2
        assert cfg["kv_bytes_per_take"] > 0
        # one persistent cache, taken at load, holds the widest batch; every batch size uses its first rows
        assert h["decode_step"]["kv_rows"] == cfg["max_batch"], h["decode_step"]
        assert h["decode_step"]["kv_bytes"] == cfg["max_batch"] * cfg["kv_bytes_per_take"], h["decode_step"]
        with cluster_of(tmp_path, [w]) as c:
            job = c.wait_job(c.submit(duration=3 / 60, num_tracks=2)["job_id"], timeout=240)
            assert job["status"] == "completed", job
            for t in job["tracks"]:
                assert t["metadata"]["batch_size"] == 2, t["metadata"]
                r = httpx.get(c.url + t["files"]["wav"], timeout=30, verify=TLS)
                assert r.status_code == 200
                audio, rate = sf.read(io.BytesIO(r.content))
                assert rate == 44100
                assert abs(len(audio) / rate - 3.0) < 0.1
                assert httpx.get(c.url + t["files"]["mp3"], timeout=30, verify=TLS).status_code == 200
            assert httpx.get(w.url + "/health", timeout=10, verify=TLS).json()["parked"] == ["decoder", "superres"]
    finally:
        w.stop()
