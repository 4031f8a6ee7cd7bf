"""A repaint of a tiny-set take, in-process: the model pipeline with the tiny checkpoint set on the CPU.

What a repaint must do: keep every code of the original outside the frames it writes anew,
``[start, join)`` (all 64 levels, on both sides), give each take of a batch its own new part,
decode to the original's very samples outside ``changed_samples`` (which stays within a second of
the new frames), and continue the prefix through the KV snapshots as a retake does. Super-resolution
fills a span with the original's cells known on both sides, and runs only the windows that hold
new frames, placed around them.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from songserve.audio import codes as codes_file
from songserve.errors import RequestError
from songserve.pipeline.context import TaskContext
from songserve.pipeline.stages.backbone import Take, shared_frames
from songserve.pipeline.stages.codec import REACH_FRAMES, decode_chunks, samples_touched
from songserve.pipeline.stages.length import plan_repaint
from songserve.pipeline.stages.superres import SuperRes, repaint_windows, span_windows
from songserve.pipeline.types import Prefix, Repaint, TrackRequest

SONG = {"lyrics": "[verse]\nkeep the ends\nrepaint the middle", "tags": "pop, piano", "duration": 0.5}
START, END, WINDOW = 215, 323, 12  # 10 s to 15 s of a half-minute take, rejoined within 12 frames of 15 s
PROMPT = list(range(3, 40))


@pytest.fixture(scope="module")
def pipeline(tiny_dir, megatron_cpu, tmp_path_factory):
    from songserve.pipeline.checkpoints.layout import resolve
    from songserve.pipeline.pipeline import ModelPipeline
    from songserve.worker.settings import WorkerSettings

    # The worker's own decoding (256-frame chunks, 16 of context): the changed samples are the decoder's
    # reach around the new frames, not the chunks that hold them.
    s = WorkerSettings(
        output_dir=tmp_path_factory.mktemp("repaint"),
        runtime_mode="keep_loaded",
    )
    pipe = ModelPipeline(s, resolve(s), megatron_cpu)
    pipe.load()
    return pipe


@pytest.fixture(scope="module")
def original(pipeline):
    """The take to repaint: its result and its code grid (64, F)."""
    got = pipeline.run(TrackRequest(**SONG, seed=3, task_id="orig"), TaskContext("orig"))
    grid = codes_file.read(pipeline.s.output_dir / got.codes_filename)
    return got, grid.codes.astype(np.int64)


def repaint(pipeline, grid: np.ndarray, seeds: tuple[int, ...], window: int = WINDOW):
    prefix = Prefix(grid.astype("<i2").tobytes(), 64, grid.shape[1], "orig/0", Repaint(START, END, window))
    reqs = [TrackRequest(**SONG, seed=s, task_id=f"r{s}", prefix=prefix) for s in seeds]
    out = pipeline.run_batch(reqs, [TaskContext(r.task_id) for r in reqs])
    for r in out:
        assert not isinstance(r, BaseException), r
    return [(r, codes_file.read(pipeline.s.output_dir / r.codes_filename).codes.astype(np.int64)) for r in out]


def decode(pipeline, grid: np.ndarray) -> torch.Tensor:
    s = pipeline.s
    codes = torch.from_numpy(grid).unsqueeze(0)
    return pipeline.residency.decoder.decode(codes, s.decode_chunk_frames, s.decode_context_frames)[0]


def test_a_repaint_keeps_the_original_outside_its_new_frames_and_its_audio_outside_changed_samples(pipeline, original):
    _, grid0 = original
    frames = grid0.shape[1]
    takes = repaint(pipeline, grid0, (11, 12, 13))
    joins = []
    for result, grid in takes:
        meta = result.metadata["repainted"]
        join = meta["join_frame"]
        joins.append(join)
        assert END - WINDOW <= join <= END + WINDOW
        assert grid.shape == grid0.shape  # as long as the original
        assert np.array_equal(grid[:, :START], grid0[:, :START])  # every level, before and after
        assert np.array_equal(grid[:, join:], grid0[:, join:])
        assert not np.array_equal(grid[:, START:join], grid0[:, START:join])
        assert result.metadata["continued"] == {
            "frames": START,
            "at_sec": pytest.approx(START * 2048 / 44100),
            "origin": "orig/0",
        }
        assert {k: meta[k] for k in ("start_frame", "end_frame", "window", "origin")} == {
            "start_frame": START,
            "end_frame": END,
            "window": WINDOW,
            "origin": "orig/0",
        }
        assert meta["join_score"] <= meta["end_score"]
        assert result.metadata["tokens"]["frames"] == frames
        first, last = meta["changed_samples"]
        rate, hop = 44100, 2048
        assert START * hop - rate <= first <= START * hop  # within a second of the new frames
        assert join * hop <= last <= join * hop + rate
        print(f"seed {result.seed}: join {join} score {meta['join_score']:.4f}, at end {meta['end_score']:.4f}")
    assert len({str(r.metadata["prefill"]) for r, _ in takes}) == 1  # one prefill for the three
    inside = [g[:, START : min(joins)] for _, g in takes]
    assert not np.array_equal(inside[0], inside[1])  # each take its own candidate
    assert not np.array_equal(inside[0], inside[2])
    assert not np.array_equal(inside[1], inside[2])

    wave0 = decode(pipeline, grid0)
    for result, grid in takes:
        first, last = result.metadata["repainted"]["changed_samples"]
        wave = decode(pipeline, grid)
        assert wave.shape == wave0.shape
        assert torch.equal(wave[..., :first], wave0[..., :first])  # the original's very samples
        assert torch.equal(wave[..., last:], wave0[..., last:])
        assert not torch.equal(wave[..., first:last], wave0[..., first:last])


def test_a_second_repaint_of_the_same_start_restores_the_prefix_kv_snapshot(pipeline, original, monkeypatch):
    _, grid0 = original
    pipeline.snapshots.clear()
    ((first, _),) = repaint(pipeline, grid0, (21,))
    monkeypatch.setattr(pipeline.s, "repaint_context_frames", 24)  # a window of the span and 24 frames each side
    ((second, grid),) = repaint(pipeline, grid0, (22,), window=0)  # another span from the same start
    sec = [r.metadata["timings"]["superres_sec"] for r in (first, second)]
    print(f"superres: {sec[0]:.2f} s over the whole take, {sec[1]:.2f} s over the span and 24 frames each side")
    tokens = first.metadata["prefill"]["tokens"]
    assert tokens == first.metadata["tokens"]["backbone_prompt"] + 2 * START  # a retake's prefix at START
    assert first.metadata["prefill"]["restored"] == 0
    assert second.metadata["prefill"]["restored"] == tokens
    assert second.metadata["repainted"]["join_frame"] == END  # no window: the join is end
    assert np.array_equal(grid[:, END:], grid0[:, END:])
    assert np.array_equal(grid[:, :START], grid0[:, :START])
    assert not np.array_equal(grid[2:, START:END], grid0[2:, START:END])


def test_windows_sit_around_the_span_and_each_samples_what_no_window_before_it_did():
    assert repaint_windows(100, 140, 1000, 100) == [(70, 170)]  # centred: 30 frames of the original each side
    assert repaint_windows(5, 40, 1000, 100) == [(0, 100)]  # moved inside the grid
    assert repaint_windows(950, 990, 1000, 100) == [(900, 1000)]
    assert repaint_windows(10, 50, 80, 100) == [(0, 80)]  # a grid that fits one window
    assert repaint_windows(10, 10, 1000, 100) == []
    # a long span: windows start a quarter window before what they sample; the last is centred on the rest
    assert repaint_windows(100, 300, 1000, 100) == [(75, 175), (150, 250), (225, 325)]


def test_superres_keeps_every_cell_outside_a_span_and_runs_only_the_windows_that_hold_it(pipeline):
    real = next(iter(pipeline.residency.superres.values()))
    small = SuperRes(real.gpt)
    small.gpt = type(real.gpt).__new__(type(real.gpt))
    small.gpt.__dict__.update(real.gpt.__dict__)
    small.gpt.arch = dataclasses.replace(real.gpt.arch, max_sequence_length=len(PROMPT) + 20)  # 20-frame windows
    g = torch.Generator().manual_seed(6)
    known = torch.randint(0, 1024, (64, 100), generator=g)
    spans = [[(40, 52)], [(45, 47)]]
    coarse = []
    for ((s, j),) in spans:
        c = known[:2].clone()
        c[:, s:j] = torch.randint(0, 1024, (2, j - s), generator=g)
        coarse.append(c)
    seen: list[tuple[int, ...]] = []
    forward = small.dm.forward
    small.dm.forward = lambda x, **kw: (seen.append(tuple(x.shape[:2])), forward(x, **kw))[1]  # type: ignore[method-assign]
    gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
    ctxs = [TaskContext("a"), TaskContext("b")]
    out = small.generate_batch(PROMPT, coarse, top_k=10, generators=gens, ctxs=ctxs, known=known, spans=spans)
    assert seen == [(2, len(PROMPT) + 20)] * 62  # one window per take, both takes in one batch, 62 passes
    seen.clear()
    near = small.generate_batch(
        PROMPT, coarse, top_k=10, generators=gens, ctxs=ctxs, known=known, spans=spans, span_context=3
    )
    assert seen == [(2, len(PROMPT) + 18)] * 62  # the longer span and 3 frames each side; the other take padded
    for got, c, ((s, j),) in zip([*out, *near], [*coarse, *coarse], [*spans, *spans], strict=True):
        assert torch.equal(got[:, :s], known[:, :s])
        assert torch.equal(got[:, j:], known[:, j:])
        assert torch.equal(got[:2], c)
        assert not torch.equal(got[2:, s:j], known[2:, s:j])


def test_a_repaint_plan_writes_every_frame_a_join_may_need_and_never_offers_end_of_audio():
    plan = plan_repaint(100, 215, 323, 12, 646, context=25600, max_new_tokens=23552)
    assert (plan.budget_frames, plan.min_frames) == (335, 335)  # the backbone offers end-of-audio from min_frames
    assert plan_repaint(100, 215, 640, 12, 646, context=25600, max_new_tokens=23552).budget_frames == 646
    with pytest.raises(RequestError, match="max_new_tokens"):
        plan_repaint(100, 215, 323, 12, 646, context=25600, max_new_tokens=200)
    with pytest.raises(RequestError, match="max_sequence_length"):
        plan_repaint(100, 215, 323, 12, 646, context=700, max_new_tokens=23552)


def test_changed_samples_are_the_decoders_reach_around_the_new_frames_within_the_chunks_that_hold_them():
    hop, r = 2048, REACH_FRAMES
    assert samples_touched(1000, 256, 16, hop, 300, 400) == ((300 - r) * hop, (400 + r) * hop)
    assert samples_touched(1000, 256, 16, hop, 500, 530) == ((500 - r) * hop, (530 + r) * hop)
    assert samples_touched(1000, 256, 16, hop, 260, 300) == ((260 - r) * hop, (300 + r) * hop)  # across a chunk edge
    assert samples_touched(200, 256, 16, hop, 5, 60) == (0, (60 + r) * hop)  # the take starts
    assert samples_touched(1000, 256, 16, hop, 900, 995) == ((900 - r) * hop, 1000 * hop)  # the take ends
    assert samples_touched(1000, 8, 12, hop, 300, 400) == ((300 - r) * hop, (400 + r) * hop)
    assert samples_touched(1000, 256, 16, hop, 50, 50) == (0, 0)
    assert [c[:2] for c in decode_chunks(600, 256, 16)] == [(0, 256), (256, 512), (512, 600)]


def test_an_opening_is_written_before_the_take_and_joins_it_inside_its_first_frames(pipeline, original):
    """An extension at the start: room for 80 new frames, then the original; the join lands at or after
    the room (inside the original), everything after it is the original's, and nothing is kept before."""
    _, grid0 = original
    room, window = 80, 12
    opened = np.concatenate([np.zeros((64, room), dtype=np.int64), grid0], axis=1)
    span = Repaint(0, room, window, opening=room)
    prefix = Prefix(opened.astype("<i2").tobytes(), 64, opened.shape[1], "orig/0", span)
    (result,) = pipeline.run_batch(
        [TrackRequest(**SONG, seed=21, task_id="open", prefix=prefix)], [TaskContext("open")]
    )
    assert not isinstance(result, BaseException), result
    grid = codes_file.read(pipeline.s.output_dir / result.codes_filename).codes.astype(np.int64)
    meta = result.metadata["repainted"]
    join = meta["join_frame"]
    assert room <= join <= room + window
    assert (meta["start_frame"], meta["opening"]) == (0, room)
    assert "continued" not in result.metadata
    assert grid.shape == opened.shape  # longer than the original by the room
    assert np.array_equal(grid[:, join:], grid0[:, join - room :])
    assert not np.array_equal(grid[:, :room], opened[:, :room])  # the placeholders were written over
    assert result.metadata["prefill"]["restored"] == 0  # nothing before it to restore


PARTS = ((108, 172), (280, 366))  # 5-8 s and 13-17 s of the half-minute take, each rejoined within 12 frames


class Watched(TaskContext):
    """A task's context that keeps every progress report."""

    def __init__(self, task_id: str) -> None:
        super().__init__(task_id)
        self.heard: list[tuple[str, int, int]] = []

    def report(self, phase: str, done: int, total: int, detail: str = "", rate: float | None = None) -> None:
        self.heard.append((phase, done, total))
        super().report(phase, done, total, detail, rate)


def test_two_parts_keep_every_code_outside_their_new_frames_and_every_sample_outside_their_changed_samples(
    pipeline, original
):
    _, grid0 = original
    parts = tuple(Repaint(s, e, WINDOW) for s, e in PARTS)
    prefix = Prefix(grid0.astype("<i2").tobytes(), 64, grid0.shape[1], "orig/0", parts[0], parts)
    reqs = [TrackRequest(**SONG, seed=s, task_id=f"p{s}", prefix=prefix) for s in (31, 32, 33)]
    ctxs = [Watched(r.task_id) for r in reqs]
    out = pipeline.run_batch(reqs, ctxs)
    for ctx in ctxs:  # the backbone's progress runs on over both parts, never back
        said = [done / total for phase, done, total in ctx.heard if phase == "backbone"]
        assert len(said) > 2
        assert said == sorted(said)
    wave0 = decode(pipeline, grid0)
    news = []
    for result in out:
        assert not isinstance(result, BaseException), result
        grid = codes_file.read(pipeline.s.output_dir / result.codes_filename).codes.astype(np.int64)
        meta = result.metadata["repainted"]
        assert len(meta["parts"]) == 2
        kept = np.ones(grid0.shape[1], dtype=bool)
        for (start, end), part in zip(PARTS, meta["parts"], strict=True):
            join = part["join_frame"]
            assert (part["start_frame"], part["end_frame"]) == (start, end)
            assert end - WINDOW <= join <= end + WINDOW
            assert part["join_score"] <= part["end_score"]
            assert not np.array_equal(grid[:, start:join], grid0[:, start:join])
            kept[start:join] = False
            print(
                f"seed {result.seed} part {start}..{end}: join {join} score {part['join_score']:.4f}, "
                f"at end {part['end_score']:.4f}"
            )
        assert np.array_equal(grid[:, kept], grid0[:, kept])  # every level, around and between the parts
        first, last = meta["parts"][0], meta["parts"][1]
        assert (meta["start_frame"], meta["end_frame"], meta["join_frame"]) == (
            PARTS[0][0],
            PARTS[1][1],
            last["join_frame"],
        )
        assert meta["changed_samples"] == [first["changed_samples"][0], last["changed_samples"][1]]
        prefill = result.metadata["prefill"]
        assert prefill["parts"][1]["own_tokens"] == 2 * (PARTS[1][0] - PARTS[0][0])  # each take's own frames
        shared = prefill["parts"][1]  # the prompt and the original before the first part, from a snapshot:
        assert shared["tokens"] == prefill["tokens"]
        # the first part's own (all of them), or, where an earlier test left a longer snapshot of the same
        # take, that one (it serves every shorter prefix but one position: its last hidden state is not kept)
        assert shared["tokens"] - 1 <= shared["restored"] <= shared["tokens"]
        wave = decode(pipeline, grid)
        same = torch.ones(wave.shape[-1], dtype=torch.bool)
        for part in meta["parts"]:
            a, b = part["changed_samples"]
            same[a:b] = False
        assert torch.equal(wave[..., same], wave0[..., same])  # the original's very samples
        news.append([grid[:, s : e - WINDOW] for s, e in PARTS])
    for k in range(2):  # three candidates, different inside both parts
        assert len({n[k].tobytes() for n in news}) == 3


def test_each_takes_own_kept_frames_prefilled_as_one_batch_give_the_codes_each_gets_alone(pipeline):
    backbone = next(iter(pipeline.residency.backbones.values()))
    g = torch.Generator().manual_seed(9)
    shared = torch.randint(0, 1024, (2, 30), generator=g)
    kept = torch.stack([torch.cat([shared, torch.randint(0, 1024, (2, 10), generator=g)], dim=1) for _ in range(3)])
    plan = plan_repaint(len(PROMPT), 40, 50, 0, 60, context=4096, max_new_tokens=4096)

    def takes(seeds):
        return [Take(torch.Generator().manual_seed(s), TaskContext(f"t{s}")) for s in seeds]

    together = backbone.generate_batch(PROMPT, plan, takes((1, 2, 3)), top_k=10, temperature=1.0, kept=kept)
    for r, seed in enumerate((1, 2, 3)):
        (alone,) = backbone.generate_batch(PROMPT, plan, takes((seed,)), top_k=10, temperature=1.0, kept=kept[r])
        assert torch.equal(together[r].codes[:, :40], kept[r])
        assert torch.equal(together[r].codes, alone.codes)
    assert together[0].prefill["own_tokens"] == 20
    assert shared_frames(kept) == 30
    assert shared_frames(kept[:1]) == 40


def test_span_windows_sample_each_span_once_and_share_a_window_between_spans_close_together():
    assert span_windows([(100, 140), (400, 420)], 1000, 100) == [
        (70, 170, [(100, 140)]),
        (360, 460, [(400, 420)]),
    ]
    # a window of the first span holds the start of the second: it samples both, the second's own window the rest
    assert span_windows([(100, 140), (160, 260)], 1000, 100) == [
        (70, 170, [(100, 140), (160, 170)]),
        (160, 260, [(170, 260)]),
    ]
    # both in the first window: the second span's own windows are dropped
    assert span_windows([(10, 20), (40, 50)], 80, 100) == [(0, 80, [(10, 20), (40, 50)])]
    assert span_windows([(100, 140)], 1000, 100, span_context=10) == [(90, 150, [(100, 140)])]
