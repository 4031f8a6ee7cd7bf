"""The worker's kept audio of its latest takes (``pipeline/stages/kept_audio.py``): an LRU bounded by bytes,
and the check that a kept take is the very original of an edit's grid."""

from __future__ import annotations

import numpy as np

from songserve.pipeline.stages.kept_audio import MAX_TAKES, Decoded, KeptAudio, usable

HOP = 4
CHUNKING = (8, 2)


def take(origin: str, frames: int = 10, seed: int = 0) -> Decoded:
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 1024, (3, frames)).astype(np.int16)
    return Decoded(origin, codes, np.zeros((frames * HOP, 2), dtype=np.float32), CHUNKING)


def test_the_least_recently_used_take_goes_first_and_none_over_the_bound_is_kept():
    one = take("a/0")
    kept = KeptAudio(3 * one.nbytes)
    for origin in ("a/0", "b/0", "c/0"):
        kept.keep(take(origin))
    assert kept.find("a/0") is not None  # now the most recently used
    kept.keep(take("d/0"))
    assert kept.describe()["origins"] == ["c/0", "a/0", "d/0"]
    assert kept.describe()["bytes"] == 3 * one.nbytes
    kept.keep(take("e/0", frames=40))  # larger than the whole bound: not kept, nothing dropped for it
    assert kept.find("e/0") is None
    assert len(kept.describe()["origins"]) == 3
    kept.keep(take("a/0", seed=1))  # a newer take under the same label replaces the older
    assert kept.describe()["origins"] == ["c/0", "d/0", "a/0"]
    nothing = KeptAudio(0)
    nothing.keep(one)
    assert nothing.describe()["origins"] == []


def test_at_most_max_takes_are_held_however_small():
    kept = KeptAudio(10**9)
    for i in range(MAX_TAKES + 5):
        kept.keep(take(f"t{i}/0", frames=2))
    origins = kept.describe()["origins"]
    assert len(origins) == MAX_TAKES
    assert origins[0] == "t5/0"  # the oldest went first


def test_a_kept_take_serves_only_a_grid_whose_kept_frames_are_its_own():
    original = take("a/0", frames=10)
    grid = original.codes.copy()
    grid[:, 3:6] = 7  # frames 3..5 written anew
    assert usable(original, grid, [(3, 6)], 0, CHUNKING, HOP)
    assert not usable(original, grid, [(3, 5)], 0, CHUNKING, HOP)  # frame 5 kept, yet not the original's
    assert not usable(original, grid, [(3, 6)], 0, (16, 2), HOP)  # decoded with other chunks
    assert not usable(original, grid[:, :9], [(3, 6)], 0, CHUNKING, HOP)  # not as long
    opened = np.concatenate([np.zeros((3, 4), dtype=np.int16), original.codes], axis=1)
    opened[:, :6] = 5  # a new opening of 4 frames, joined 2 frames into the original
    assert usable(original, opened, [(0, 6)], 4, CHUNKING, HOP)
    assert not usable(original, opened, [(0, 6)], 3, CHUNKING, HOP)
