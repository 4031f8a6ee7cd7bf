"""A take that continues a prefix (a retake): its kept frames as the stages take them, and what its files say.

The stages never see a ``Prefix``: the backbone gets the kept q0/q1 codes, super-resolution all
64 levels of the kept frames, and the decoder the whole grid. Checked here, before any work: the
grid has the levels the models write, and leaves frames to generate.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from songserve.errors import RequestError
from songserve.pipeline.numbers import CODEBOOK, HOP
from songserve.pipeline.types import Prefix


def kept_codes(prefix: Prefix, levels: int, budget_frames: int) -> torch.Tensor:
    """The prefix's grid as (levels, K) long codes, or a ``RequestError`` saying why it cannot be continued."""
    if prefix.levels != levels:
        raise RequestError(f"The prefix has {prefix.levels} code levels; these models write {levels}.")
    if prefix.frames >= budget_frames:
        raise RequestError(
            f"The prefix's {prefix.frames} frames leave nothing to generate in a song of {budget_frames} frames; "
            "ask for a longer duration or continue from an earlier point."
        )
    grid = np.frombuffer(prefix.raw, dtype="<i2").reshape(prefix.levels, prefix.frames)
    if grid.size and (int(grid.min()) < 0 or int(grid.max()) >= CODEBOOK):
        raise RequestError(f"The prefix's codes must be in [0, {CODEBOOK}).")
    return torch.from_numpy(grid.astype(np.int64))


def continued(prefix: Prefix, frame_rate: float) -> dict[str, Any]:
    """The metadata's ``continued``: how many frames were kept, where the new part starts, from what."""
    return {"frames": prefix.frames, "at_sec": round(prefix.frames / frame_rate, 6), "origin": prefix.origin}


def codes_header(metadata: dict[str, Any], frame_rate: float) -> dict[str, Any]:
    """The codes file's header (``songserve/audio/codes.py``): which models made the grid, with which seed."""
    keys = ("job_id", "track_index", "task_id", "seed", "sample_rate")
    head: dict[str, Any] = {k: metadata[k] for k in keys if k in metadata}
    head["models"] = {k: v for k, v in metadata.get("models", {}).items() if k in ("backbone", "superres")}
    head["frame_rate"] = frame_rate
    head["hop"] = HOP
    if "continued" in metadata:
        head["continued"] = metadata["continued"]
    if "adapter" in metadata:  # a retake of this grid uses the same adapter and scale
        head["adapter"] = metadata["adapter"]
    return head
