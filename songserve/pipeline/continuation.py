"""A take that continues a prefix (a retake or a repaint): its kept frames as the stages take them, and what its files say.

The stages never see a ``Prefix``: the backbone gets the kept q0/q1 codes, super-resolution all
64 levels of the kept frames, and the decoder the whole grid. Checked here, before any work: the
grid has the levels the models write, and (a retake) leaves frames to generate. A repaint's grid is
a whole take: the backbone continues its frames before the span, and its coarse codes are spliced
back into the original's at the join (``splice``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from songserve.errors import RequestError
from songserve.pipeline.numbers import CODEBOOK, HOP
from songserve.pipeline.stages.join import Join
from songserve.pipeline.types import Prefix


def prefix_grid(prefix: Prefix, levels: int) -> torch.Tensor:
    """The prefix's whole grid as (levels, frames) long codes, or a ``RequestError`` saying why it cannot be used."""
    if prefix.levels != levels:
        raise RequestError(f"The prefix has {prefix.levels} code levels; these models write {levels}.")
    grid = np.frombuffer(prefix.raw, dtype="<i2").reshape(prefix.levels, prefix.frames)
    if grid.size and (int(grid.min()) < 0 or int(grid.max()) >= CODEBOOK):
        raise RequestError(f"The prefix's codes must be in [0, {CODEBOOK}).")
    return torch.from_numpy(grid.astype(np.int64))


def kept_codes(prefix: Prefix, levels: int, budget_frames: int) -> torch.Tensor:
    """The prefix's grid as (levels, K) long codes, or a ``RequestError`` saying why it cannot be continued."""
    if prefix.levels != levels:
        raise RequestError(f"The prefix has {prefix.levels} code levels; these models write {levels}.")
    if prefix.frames >= budget_frames:
        raise RequestError(
            f"The prefix's {prefix.frames} frames leave nothing to generate in a song of {budget_frames} frames; "
            "ask for a longer duration or continue from an earlier point."
        )
    return prefix_grid(prefix, levels)


def splice(original: torch.Tensor, new: torch.Tensor, start: int, join: int) -> torch.Tensor:
    """A repaint's coarse codes (2, F): the original's before ``start`` and from ``join`` on, the new take's
    between (for a later part, ``original`` is the take's codes so far)."""
    return torch.cat([original[:2, :start], new[:2, start:join], original[:2, join:]], dim=1)


def continued(prefix: Prefix, frame_rate: float) -> dict[str, Any]:
    """The metadata's ``continued``: how many frames were kept, where the new part starts, from what
    (a repaint's kept start: the frames before its span)."""
    frames = prefix.repaint.start if prefix.repaint is not None else prefix.frames
    return {"frames": frames, "at_sec": round(frames / frame_rate, 6), "origin": prefix.origin}


def repainted(prefix: Prefix, joins: list[Join], touched: list[tuple[int, int]]) -> dict[str, Any]:
    """The metadata's ``repainted``: per part (``parts``) the span asked for, the join chosen with its score
    and the score of joining at ``end`` exactly (lower is closer, ``stages/join.py``), and the samples
    ``[first, last)`` that may differ from the original's decode (outside them the audio is the original's).

    Its own fields are the whole repaint's as a single part's are: the first part's start, the last part's
    end, join and scores, the bound of every part's changed samples."""
    spans = prefix.repaints()
    assert spans
    parts = [
        {
            "start_frame": span.start,
            "end_frame": span.end,
            "join_frame": join.frame,
            "join_score": round(join.score, 6),
            "end_score": round(join.end_score, 6),
            "changed_samples": list(samples),
        }
        for span, join, samples in zip(spans, joins, touched, strict=True)
    ]
    last = parts[-1]
    return {
        "start_frame": spans[0].start,
        **{k: last[k] for k in ("end_frame", "join_frame", "join_score", "end_score")},
        "window": spans[0].window,
        "opening": spans[0].opening,
        "origin": prefix.origin,
        "changed_samples": [min(a for a, _ in touched), max(b for _, b in touched)],
        "parts": parts,
    }


def codes_header(metadata: dict[str, Any], frame_rate: float) -> dict[str, Any]:
    """The codes file's header (``songserve/audio/codes.py``): which models made the grid, with which seed."""
    keys = ("job_id", "track_index", "task_id", "seed", "sample_rate")
    head: dict[str, Any] = {k: metadata[k] for k in keys if k in metadata}
    head["models"] = {k: v for k, v in metadata.get("models", {}).items() if k in ("backbone", "superres")}
    head["frame_rate"] = frame_rate
    head["hop"] = HOP
    for key in ("continued", "repainted", "adapter"):  # "adapter": a retake of this grid uses the same one
        if key in metadata:
            head[key] = metadata[key]
    return head
