"""An edit decodes only the chunks it changes, against its original's audio kept on the worker.

The model pipeline with the tiny set on the CPU: a take made here keeps its decoded audio
(``stages/kept_audio.py``); a repaint, a repaint of two parts and a new opening of that take decode
only the decoder chunks that hold changed samples. Each one's WAV is the original's WAV outside its
``changed_samples`` and a decode of its whole grid within them; for a repaint the two agree everywhere,
so its WAV is the whole decode's, sample for sample. A new opening moves the decoder's chunks against
the original's frames, and a whole decode of its grid differs from the original by a least significant
bit here and there after the join (seen: 374 samples, none by more than 1): from the kept audio those
samples are the original's, as ``changed_samples`` says. An edit whose grid is not the kept take's
decodes the whole grid.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile as sf
import torch

from songserve.audio import codes as codes_file
from songserve.pipeline.context import TaskContext
from songserve.pipeline.stages.codec import decode_chunks
from songserve.pipeline.types import Prefix, Repaint, TrackRequest

SONG = {"lyrics": "[verse]\nkeep the ends\nrepaint the middle", "tags": "pop, piano", "duration": 0.5}
WINDOW = 12


@pytest.fixture(scope="module")
def pipeline(tiny_dir, megatron_cpu, tmp_path_factory):
    from songserve.pipeline.checkpoints.layout import resolve
    from songserve.pipeline.pipeline import ModelPipeline
    from songserve.worker.settings import WorkerSettings

    # 64-frame chunks: a half-minute take has 11, so an edit's few are told from the whole grid's
    s = WorkerSettings(
        output_dir=tmp_path_factory.mktemp("edit_decode"), runtime_mode="keep_loaded", decode_chunk_frames=64
    )
    pipe = ModelPipeline(s, resolve(s), megatron_cpu)
    pipe.load()
    return pipe


@pytest.fixture(scope="module")
def made(pipeline):
    """A take of job ``song`` (its audio kept under ``song/0``): its grid (64, F) and its WAV's samples."""
    got = pipeline.run(TrackRequest(**SONG, seed=3, task_id="orig", job_id="song"), TaskContext("orig"))
    assert "song/0" in pipeline.kept_audio.describe()["origins"]
    grid = codes_file.read(pipeline.s.output_dir / got.codes_filename).codes.astype(np.int64)
    return grid, pcm16(pipeline.s.output_dir / got.wav_filename)


@pytest.fixture(scope="module")
def original(made):
    return made[0]


def pcm16(path) -> np.ndarray:
    return sf.read(path, dtype="int16")[0]


def whole_decode_pcm16(pipeline, grid: np.ndarray) -> np.ndarray:
    """The WAV's samples a decode of the whole grid gives (written and read back as the export writes it)."""
    s = pipeline.s
    decoder = pipeline.residency.decoder
    codes = torch.from_numpy(grid[: decoder.cfg.n_codebooks]).unsqueeze(0)
    wave = decoder.decode(codes, s.decode_chunk_frames, s.decode_context_frames)[0]
    buf = io.BytesIO()
    sf.write(buf, wave.float().t().numpy(), decoder.cfg.sample_rate, format="WAV", subtype="PCM_16")
    buf.seek(0)
    return sf.read(buf, dtype="int16")[0]


def edit(pipeline, grid: np.ndarray, parts: tuple[Repaint, ...], seeds: tuple[int, ...], origin: str = "song/0"):
    prefix = Prefix(grid.astype("<i2").tobytes(), 64, grid.shape[1], origin, parts[0], parts if len(parts) > 1 else ())
    job = f"edit{seeds[0]}"
    reqs = [
        TrackRequest(**SONG, seed=s, task_id=f"e{s}", job_id=job, track_index=i, prefix=prefix)
        for i, s in enumerate(seeds)
    ]
    out = pipeline.run_batch(reqs, [TaskContext(r.task_id) for r in reqs])
    for r in out:
        assert not isinstance(r, BaseException), r
    return out


def chunks_of(pipeline, frames: int) -> int:
    return len(decode_chunks(frames, pipeline.s.decode_chunk_frames, pipeline.s.decode_context_frames))


@pytest.mark.parametrize(
    ("name", "parts"),
    [
        ("a repaint of 10-15 s", (Repaint(215, 323, WINDOW),)),
        ("a repaint in two parts", (Repaint(108, 172, WINDOW), Repaint(280, 366, WINDOW))),
    ],
)
def test_a_repaints_audio_decodes_only_its_changed_chunks_and_is_the_whole_decodes(
    pipeline, original, made, name, parts
):
    hits = pipeline.kept_audio.hits
    out = edit(pipeline, original, parts, (41, 42))
    total = chunks_of(pipeline, original.shape[1])
    for result in out:
        grid = codes_file.read(pipeline.s.output_dir / result.codes_filename).codes.astype(np.int64)
        decoded, of = result.metadata["repainted"]["decoded_chunks"]
        assert of == total
        assert 0 < decoded < total, (name, decoded, of)
        got, whole = pcm16(pipeline.s.output_dir / result.wav_filename), whole_decode_pcm16(pipeline, grid)
        assert got.shape == whole.shape
        assert np.array_equal(got, whole), f"{name}: {int((got != whole).any(axis=1).sum())} samples differ"
        same = np.ones(len(got), dtype=bool)
        for part in result.metadata["repainted"]["parts"]:
            same[slice(*part["changed_samples"])] = False
        assert np.array_equal(got[same], made[1][same])  # and the original's outside its changed samples
        print(f"{name}, seed {result.seed}: decoded {decoded} of {of} chunks")
    assert pipeline.kept_audio.hits == hits + 2


def test_an_openings_audio_is_the_originals_after_its_changed_samples_and_the_whole_decodes_within(
    pipeline, original, made
):
    room = 80
    opened = np.concatenate([np.zeros((64, room), dtype=np.int64), original], axis=1)
    (result,) = edit(pipeline, opened, (Repaint(0, room, WINDOW, opening=room),), (51,))
    grid = codes_file.read(pipeline.s.output_dir / result.codes_filename).codes.astype(np.int64)
    decoded, of = result.metadata["repainted"]["decoded_chunks"]
    assert of == chunks_of(pipeline, opened.shape[1])
    assert 0 < decoded <= 3, (decoded, of)
    got, whole = pcm16(pipeline.s.output_dir / result.wav_filename), whole_decode_pcm16(pipeline, grid)
    first, last = result.metadata["repainted"]["changed_samples"]
    hop = pipeline.residency.decoder.cfg.hop
    assert first == 0
    assert last > room * hop
    assert np.array_equal(got[:last], whole[:last])
    assert np.array_equal(got[last:], made[1][last - room * hop :])  # the original's very samples


def test_an_edit_of_another_grid_under_a_kept_label_decodes_the_whole_grid(pipeline, original):
    """The label says ``song/0``, but the grid's kept frames are not that take's: nothing of its audio is used."""
    other = original.copy()
    other[:, -5:] = (other[:, -5:] + 1) % 1024  # kept frames at the end that the kept take does not hold
    misses = pipeline.kept_audio.misses
    (result,) = edit(pipeline, other, (Repaint(215, 323, WINDOW),), (61,))
    total = chunks_of(pipeline, other.shape[1])
    assert result.metadata["repainted"]["decoded_chunks"] == [total, total]
    assert pipeline.kept_audio.misses == misses + 1
    grid = codes_file.read(pipeline.s.output_dir / result.codes_filename).codes.astype(np.int64)
    assert np.array_equal(pcm16(pipeline.s.output_dir / result.wav_filename), whole_decode_pcm16(pipeline, grid))


def test_an_edit_is_kept_too_so_an_edit_of_the_edit_decodes_only_its_own_chunks(pipeline, original):
    (first,) = edit(pipeline, original, (Repaint(215, 323, WINDOW),), (71,))
    grid = codes_file.read(pipeline.s.output_dir / first.codes_filename).codes.astype(np.int64)
    (second,) = edit(pipeline, grid, (Repaint(100, 160, WINDOW),), (72,), origin="edit71/0")
    decoded, of = second.metadata["repainted"]["decoded_chunks"]
    assert 0 < decoded < of
    grid2 = codes_file.read(pipeline.s.output_dir / second.codes_filename).codes.astype(np.int64)
    assert np.array_equal(pcm16(pipeline.s.output_dir / second.wav_filename), whole_decode_pcm16(pipeline, grid2))
