"""Song length as the reference: end-of-audio ends the song, a token budget, context refusal."""

from __future__ import annotations

import math
import re

import httpx
import pytest
import torch

from songserve.errors import RequestError
from songserve.pipeline.context import TaskContext
from songserve.pipeline.numbers import TOKENS_PER_MINUTE
from songserve.pipeline.stages.length import plan_length
from songserve.pipeline.types import TrackRequest
from tests.support.http import TLS
from tests.support.servers import start_worker
from tests.support.tiny_site import lent

FPS = 44100 / 2048


def test_plan_for_a_real_set_is_the_reference_budget_capped_by_the_context():
    plan = plan_length(100, 2.0, FPS, context=25600, max_new_tokens=23552, min_share=0.0)
    assert plan.budget_frames == 23552 // 2
    assert plan.min_frames == 1
    assert plan.estimate_tokens == round(TOKENS_PER_MINUTE * 2.8)
    capped = plan_length(5000, 2.0, FPS, context=25600, max_new_tokens=23552, min_share=0.0)
    assert capped.budget_frames == (25600 - 5000) // 2  # the context is the cap


def test_plan_with_a_full_share_is_exactly_the_requested_length():
    plan = plan_length(100, 0.5, FPS, context=27648, max_new_tokens=23552, min_share=1.0)
    assert plan.budget_frames == plan.min_frames == int(0.5 * 60 * FPS)


def test_the_token_budget_caps_an_exact_length_plan_too():
    plan = plan_length(100, 0.5, FPS, context=27648, max_new_tokens=128, min_share=1.0)
    assert plan.budget_frames == plan.min_frames == 64


def test_the_token_budget_counts_only_tokens_to_generate_not_the_kept_prefix():
    """--num-tokens-to-generate 128 (64 new frames) with 100 kept frames: the song may run to 164 frames;
    a budget that counted the kept prefix would be spent by it alone, and every continuation refused."""
    exact = plan_length(100, 0.5, FPS, context=27648, max_new_tokens=128, min_share=1.0, kept_frames=100)
    assert exact.budget_frames == 100 + 64
    model = plan_length(100, 2.0, FPS, context=25600, max_new_tokens=128, min_share=0.0, kept_frames=100)
    assert model.budget_frames == 100 + 64
    full = plan_length(100, 2.0, FPS, context=25600, max_new_tokens=23552, min_share=0.0, kept_frames=2000)
    assert full.budget_frames == (25600 - 100) // 2  # the context still caps kept plus new


def test_a_request_longer_than_the_context_is_refused_naming_the_limit():
    with pytest.raises(RequestError, match=r"context of 25600 tokens \(max_sequence_length\)"):
        plan_length(100, 10.0, FPS, context=25600, max_new_tokens=23552, min_share=0.0)  # 25,840 + 100 tokens


@pytest.fixture(scope="module")
def pipeline(tiny_dir, megatron_cpu, tmp_path_factory):
    from songserve.pipeline.checkpoints.layout import resolve
    from songserve.pipeline.pipeline import ModelPipeline
    from songserve.worker.settings import WorkerSettings

    s = WorkerSettings(
        output_dir=tmp_path_factory.mktemp("length"), runtime_mode="keep_loaded", eoa_min_share=0.0, max_new_tokens=300
    )
    pipe = ModelPipeline(s, resolve(s), megatron_cpu)
    pipe.load()
    return pipe


def _eod_logit(pipeline, monkeypatch, value):
    """Replace the end-of-document logit: +1e4 = the model ends the song now, -1e4 = never."""
    backbone = next(iter(pipeline.residency.backbones.values()))
    gpt, real = backbone.gpt, backbone.gpt.project

    def project(hidden, start, stop):
        logits = real(hidden, start, stop)
        return logits * 0 + value if (start, stop) == (backbone.eod_id, backbone.eod_id + 1) else logits

    monkeypatch.setattr(gpt, "project", project)


def _song(pipeline, duration=0.5):
    ctx = TaskContext("len")
    r = pipeline.run(TrackRequest(lyrics="la la", tags="pop", duration=duration, seed=5, task_id="len"), ctx)
    return r, ctx


def test_the_model_ends_the_song_with_its_end_of_audio(pipeline, monkeypatch):
    _eod_logit(pipeline, monkeypatch, 1e4)
    r, _ = _song(pipeline)
    assert r.metadata["stopped_by"] == "end_of_audio"
    assert r.metadata["tokens"]["backbone_new"] == 2  # no floor but one frame: the first offer ends it
    assert r.metadata["tokens"]["frames"] == 1


def test_without_end_of_audio_the_token_budget_holds(pipeline, monkeypatch):
    _eod_logit(pipeline, monkeypatch, -1e4)
    r, ctx = _song(pipeline, duration=0.05)  # 64 frames asked; the budget (300 tokens) is what holds
    assert r.metadata["stopped_by"] == "budget"
    assert r.metadata["tokens"]["backbone_new"] == 300
    assert r.metadata["tokens"]["frames"] == 150
    assert math.isclose(r.duration_sec, 150 * 2048 / 44100, rel_tol=1e-6)


def test_progress_detail_is_the_reference_token_count_with_the_rate_beside_it(pipeline, monkeypatch):
    _eod_logit(pipeline, monkeypatch, -1e4)
    reports = []
    real = TaskContext.report

    def report(self, phase, done, total, detail="", rate=None):
        if phase == "backbone":
            reports.append((detail, rate))
        real(self, phase, done, total, detail, rate)

    monkeypatch.setattr(TaskContext, "report", report)
    _song(pipeline, duration=0.05)
    estimate = round(TOKENS_PER_MINUTE * (0.05 + 0.8))
    # Exactly what the reference dispatcher parses (r"^\s*(\d+)\s*/\s*\d+\s+tokens\s*$"); the rate apart.
    assert reports
    assert all(re.fullmatch(rf"\d+/{estimate} tokens", d) for d, _ in reports), reports[:3]
    assert all(r is not None and r > 0 for _, r in reports)
    assert reports[-1][0] == f"300/{estimate} tokens"


def test_a_request_longer_than_the_context_gets_a_clear_error_before_any_work(shared_tiny):
    with lent(shared_tiny) as w:  # the process's tiny-model worker (tests/support/tiny_site.py)
        done_before = httpx.get(w.url + "/health", timeout=10, verify=TLS).json()["tasks_done"]
        cfg = httpx.get(w.url + "/config", timeout=10, verify=TLS).json()
        assert cfg["max_sequence_length"] == 27648
        assert cfg["max_new_tokens"] == 23552
        assert cfg["max_prompt_length"] > 0
        assert cfg["tokens_per_minute"] == 2584
        r = httpx.post(
            w.url + "/generate", json={"lyrics": "la", "tags": "pop", "duration": 15}, timeout=60, verify=TLS
        )
        assert r.status_code == 400
        assert "context of 27648 tokens (max_sequence_length)" in r.json()["error"]
        h = httpx.get(w.url + "/health", timeout=10, verify=TLS).json()
        assert h["status"] == "idle"
        assert h["tasks_done"] == done_before  # refused before any work: no task counted


def test_the_floor_default_is_exact_length_for_the_tiny_set_and_none_for_a_real_one(tiny_dir, tmp_path):
    import dataclasses

    from songserve.pipeline.checkpoints.layout import resolve
    from songserve.pipeline.pipeline import ModelPipeline
    from songserve.worker.settings import WorkerSettings

    s = WorkerSettings(output_dir=tmp_path)
    ckpt = resolve(s)
    cpu = torch.device("cpu")
    assert ModelPipeline(s, ckpt, cpu).min_share() == 1.0
    assert ModelPipeline(s, dataclasses.replace(ckpt, tiny=False, untrained=False), cpu).min_share() == 0.0
    s2 = WorkerSettings(output_dir=tmp_path, eoa_min_share=0.5)
    assert ModelPipeline(s2, ckpt, cpu).min_share() == 0.5


@pytest.mark.process
def test_a_worker_with_the_references_token_flag_continues_a_take_longer_than_its_budget(tiny_dir, tmp_path):
    """``--num-tokens-to-generate 128``: 64 new frames a take. A retake of a 64-frame take kept from 2 s
    (43 frames) asks for 0.1 minutes (129 frames); the kept frames are prefilled, not generated, so the take
    runs past 64 frames (it was cut at 64: the kept frames were counted against the budget)."""
    from tests.support.servers import cluster_of

    worker = start_worker(tmp_path, "--num-tokens-to-generate", "128", name="tiny")  # as the reference launches
    with cluster_of(tmp_path, [worker]) as c:
        first = c.submit(tags="pop", lyrics="[verse]\nla la", duration=0.05, num_tracks=1)
        done = c.wait_job(first["job_id"], timeout=240)
        assert done["status"] == "completed", done
        body = {"continue_from": {"job_id": first["job_id"], "track_index": 0, "at_sec": 2.0}, "duration": 0.1}
        retake = httpx.post(c.url + "/generate", json={**body, "num_tracks": 1}, timeout=10, verify=TLS).json()
        job = c.wait_job(retake["job_id"], timeout=240)
        assert job["status"] == "completed", job["tracks"][0]["error"]
        meta = job["tracks"][0]["metadata"]
        assert meta["continued"]["frames"] == int(2.0 * FPS)
        assert meta["tokens"]["frames"] > 64  # past what 128 tokens alone could hold
