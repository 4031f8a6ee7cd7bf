"""Live audio in-process: ``LiveAudio``'s states and file, and the ``Previewer`` on the tiny set's models.

What is proved: the states move only as ``pipeline/live.py`` draws them (final states stay); the
file holds the PCM libsndfile would write for the same samples; the previewer does nothing for a
take nobody wants, makes all of a wanted take's audio (a window at a time, the last frames at
``close``), keeps making one take's audio when another take of the batch is cancelled, and a
take first wanted after the backbone is missed; it draws from its own generator, so the take's
codes are the same with and without it.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile as sf
import torch

from songserve.pipeline.checkpoints.gpt_load import load_model
from songserve.pipeline.context import TaskContext
from songserve.pipeline.live_audio.previewer import Previewer, PreviewStages
from songserve.pipeline.live_audio.take import LiveAudio, LiveState
from songserve.pipeline.stages import tokenizer as tk
from songserve.pipeline.stages.backbone import Backbone, Take
from songserve.pipeline.stages.codec import load_decoder
from songserve.pipeline.stages.length import LengthPlan
from songserve.pipeline.stages.superres import SuperRes

PROMPT = list(range(3, 40))
FRAMES = 120  # ≈ 5.6 s: three windows of 40 frames


def test_live_audio_moves_only_along_its_machine_and_writes_libsndfiles_samples(tmp_path):
    live = LiveAudio("t1")
    assert live.state is LiveState.idle
    live.complete()  # not a move from idle
    assert live.state is LiveState.idle
    assert live.want() is LiveState.wanted
    live.open(tmp_path)
    x = (0.5 * np.sin(np.linspace(0, 60, 4410))).astype(np.float32)
    samples = np.stack([x, -x], axis=1)
    live.append(samples)
    assert live.state is LiveState.live
    assert live.frames_written == 4410
    assert live.seconds == pytest.approx(0.1)
    ref = io.BytesIO()
    sf.write(ref, samples, 44_100, format="WAV", subtype="PCM_16")
    assert (tmp_path / "t1.live.pcm").read_bytes() == sf.read(io.BytesIO(ref.getvalue()), dtype="int16")[0].tobytes()
    live.complete()
    live.fail("late")  # final states stay
    live.close_window()
    assert live.state is LiveState.complete
    live.remove()
    assert not (tmp_path / "t1.live.pcm").exists()

    unheard = LiveAudio("t2")
    unheard.close_window()
    assert unheard.state is LiveState.missed
    assert unheard.want() is LiveState.missed  # too late: it stays missed


@pytest.fixture(scope="module")
def models(tiny_dir, megatron_cpu):
    tok = tk.load_tokenizer(tiny_dir / "tokenizer")
    bb = Backbone(load_model(tiny_dir / "backbone", megatron_cpu, torch.float32), tok.token_id(tk.EOD))
    sr = SuperRes(load_model(tiny_dir / "superres", megatron_cpu, torch.float32))
    decoder = load_decoder(tiny_dir / "decoder" / "config.yaml", tiny_dir / "decoder" / "model.pth", megatron_cpu)
    return bb, sr, decoder


def backbone_run(models, ctxs, previewer, seeds):
    bb = models[0]
    takes = [Take(torch.Generator().manual_seed(s), c) for s, c in zip(seeds, ctxs, strict=True)]
    plan = LengthPlan(FRAMES, FRAMES, 2 * FRAMES)
    return bb.generate_batch(PROMPT, plan, takes, top_k=50, temperature=1.0, listener=previewer)


def previewer(models, ctxs, seeds, tmp_path):
    _, sr, decoder = models
    return Previewer(
        ctxs,
        seeds,
        FRAMES,
        lambda: PreviewStages(sr, PROMPT, decoder),
        out_dir=tmp_path,
        device=torch.device("cpu"),
        chunk_frames=40,
        context_frames=8,
        decode_context=16,
        top_k=10,
    )


def test_a_wanted_take_is_previewed_whole_and_its_codes_are_what_they_are_unheard(models, tmp_path):
    quiet = backbone_run(models, [TaskContext("q")], None, [4])
    ctx = TaskContext("heard")
    ctx.live.want()
    pv = previewer(models, [ctx], [4], tmp_path)
    heard = backbone_run(models, [ctx], pv, [4])
    pv.close()
    assert torch.equal(quiet[0].codes, heard[0].codes)  # the preview draws from its own generator
    assert ctx.live.state is LiveState.complete
    hop = models[2].cfg.hop
    assert ctx.live.frames_written == FRAMES * hop  # every frame, once
    assert pv.report(0)["windows"] >= 2
    pcm = np.frombuffer((tmp_path / "heard.live.pcm").read_bytes(), dtype="<i2")
    assert pcm.size == 2 * FRAMES * hop
    assert np.abs(pcm).max() > 0


def test_a_cancelled_take_fails_its_preview_and_the_other_take_is_previewed_whole(models, tmp_path):
    keep, drop = TaskContext("keep"), TaskContext("drop")
    for c in (keep, drop):
        c.live.want()
    pv = previewer(models, [keep, drop], [1, 2], tmp_path)
    drop.cancel()
    backbone_run(models, [keep, drop], pv, [1, 2])
    pv.close()
    assert keep.live.state is LiveState.complete
    assert drop.live.state is LiveState.failed


def test_nobody_listening_costs_no_preview_and_a_take_wanted_too_late_is_missed(models, tmp_path):
    ctx = TaskContext("late")
    pv = previewer(models, [ctx], [3], tmp_path)
    backbone_run(models, [ctx], pv, [3])
    assert pv._thread is None  # no thread, no window, no file
    ctx.live.want()  # after the backbone's last tokens
    pv.close()
    assert ctx.live.state is LiveState.missed
    assert not list(tmp_path.glob("*.live.pcm"))
