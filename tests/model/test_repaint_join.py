"""The repaint's join chooser (``stages/join.py``) on codes built so the best join is known: no model, no event loop.

The tier is the model's because the chooser works on torch tensors; nothing here loads a model.
"""

from __future__ import annotations

import pytest
import torch

from songserve.pipeline.stages.join import RADIUS, choose_join, join_range


def codes(frames: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 1024, (2, frames), generator=torch.Generator().manual_seed(seed))


def agreeing_at(original: torch.Tensor, frame: int, seed: int = 1) -> torch.Tensor:
    """New codes unlike the original's everywhere but the frames a join at ``frame`` compares."""
    new = (original + 1 + codes(original.shape[1], seed) % 1000) % 1024
    new[:, frame - RADIUS : frame + RADIUS] = original[:, frame - RADIUS : frame + RADIUS]
    return new


def test_the_range_is_the_window_around_end_after_start_and_inside_the_grid():
    assert join_range(10, 50, 8, 100) == (42, 58)
    assert join_range(45, 50, 8, 100) == (46, 58)
    assert join_range(10, 98, 8, 100) == (90, 100)
    assert join_range(10, 50, 0, 100) == (50, 50)


def test_it_finds_the_frame_where_the_new_codes_meet_the_original():
    original = codes(120, seed=0)
    new = agreeing_at(original, 57)
    got = choose_join(original, new, start=20, end=60, window=10)
    assert got.frame == 57
    assert got.score == 0.0
    assert got.end_score > 0.0


def test_with_codebook_latents_a_close_code_scores_better_than_a_far_one():
    tables = torch.zeros(2, 1024, 4)
    tables[0, :, 0] = torch.arange(1024, dtype=torch.float32)  # level 0's latent is the code itself; level 1 adds none
    original = torch.zeros(2, 100, dtype=torch.long)
    original[0] = 500
    new = torch.zeros(2, 100, dtype=torch.long)
    new[0] = 900  # far everywhere ...
    new[0, 62 - RADIUS : 62 + RADIUS] = 503  # ... but close, never equal, around frame 62
    got = choose_join(original, new, start=10, end=60, window=5, tables=tables)
    assert got.frame == 62
    assert got.score == pytest.approx(3.0)
    assert choose_join(original, new, start=10, end=60, window=5).frame == 60  # equal codes see no difference: end


def test_ties_go_to_the_frame_closest_to_end():
    original = codes(100, seed=2)
    new = original.clone()  # the same everywhere: every join scores 0
    assert choose_join(original, new, start=10, end=50, window=7).frame == 50
    far = agreeing_at(original, 44, seed=3)
    far[:, 53 - RADIUS : 53 + RADIUS] = original[:, 53 - RADIUS : 53 + RADIUS]  # 44 and 53 both score 0
    assert choose_join(original, far, start=10, end=50, window=7).frame == 53  # 3 from end, not 6


def test_window_zero_joins_at_end():
    original = codes(100, seed=4)
    new = agreeing_at(original, 47)
    got = choose_join(original, new, start=10, end=50, window=0)
    assert got.frame == 50
    assert got.score == got.end_score


def test_a_join_never_falls_before_start_plus_one_nor_past_the_grid():
    original = codes(60, seed=5)
    new = agreeing_at(original, 12)
    assert choose_join(original, new, start=12, end=14, window=10).frame >= 13
    tail = (original + 7) % 1024
    tail[:, 58:] = original[:, 58:]  # alike only in the grid's last frames: the join is the grid's end
    got = choose_join(original, tail, start=40, end=58, window=10)
    assert (got.frame, got.score) == (60, 0.0)


def test_new_codes_that_stop_short_of_the_range_are_refused():
    with pytest.raises(ValueError, match="needs them all"):
        choose_join(codes(100, seed=6), codes(55, seed=7), start=10, end=50, window=8)


def test_an_openings_join_lands_at_or_after_its_placeholders_and_scores_only_real_frames():
    assert join_range(0, 40, 8, 100, floor=40) == (40, 48)
    original = codes(120, seed=3)
    new = agreeing_at(original, 36)  # the best match lies inside the placeholders: never chosen
    new[:, 44 - RADIUS : 44 + RADIUS] = original[:, 44 - RADIUS : 44 + RADIUS]
    got = choose_join(original, new, start=0, end=40, window=8, floor=40)
    assert got.frame == 44
    assert got.score == 0.0
