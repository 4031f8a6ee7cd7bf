"""How long a take may run: the frame budget of a request, decided before any work.

The reference's semantics (the model's end-of-audio ends a song) with our floor (``min_share``)
and the limits that refuse a request before it runs: the model's context and the token budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from songserve.errors import RequestError
from songserve.pipeline.numbers import TOKENS_PER_MINUTE


@dataclass(frozen=True)
class LengthPlan:
    """How long a song may run: the reference's semantics (end-of-audio ends it) with our floor."""

    budget_frames: int  # the most frames (tokens / 2) the loop writes
    min_frames: int  # end-of-audio is offered from this frame on
    estimate_tokens: int  # progress denominator: 2,584 × (d + 0.8)


def plan_length(
    prompt_len: int,
    duration_min: float,
    frame_rate: float,
    *,
    context: int,
    max_new_tokens: int,
    min_share: float,
    kept_frames: int = 0,
) -> LengthPlan:
    """The request's frame budget, or a ``RequestError`` naming the limit before any work.

    ``min_share`` ≥ 1 means exact length (the tiny set: its end-of-audio is untrained noise), so
    the budget is the requested length. Otherwise the budget is the reference's token budget,
    capped by the context, and the model ends the song itself. Either way the token budget
    (``MAX_NEW_TOKENS``, the launcher's ``--num-tokens-to-generate``) caps it; it counts tokens *to
    generate*, so a retake's or an upload's ``kept_frames`` (prefilled, not generated) are not charged
    to it: the song may run to the kept frames plus the budget.
    """
    requested = max(1, int(duration_min * 60 * frame_rate))
    room = context - prompt_len
    if prompt_len + 2 * requested > context:
        raise RequestError(
            f"The request needs {prompt_len} prompt tokens plus {2 * requested} audio tokens "
            f"({duration_min:g} min), more than the model's context of {context} tokens (max_sequence_length)."
        )
    if min_share >= 1.0:
        budget = min(requested, kept_frames + max_new_tokens // 2)
    else:
        budget = min(2 * kept_frames + max_new_tokens, room) // 2
    estimate = round(TOKENS_PER_MINUTE * (duration_min + 0.8))
    floor = max(1, math.ceil(min_share * requested))  # at least one frame: the decoder needs audio to decode
    return LengthPlan(budget, min(budget, floor), estimate)


def plan_repaint(
    prompt_len: int, start: int, end: int, window: int, frames: int, *, context: int, max_new_tokens: int
) -> LengthPlan:
    """A repaint's fixed budget: every frame a join may need, ``min(end + window, frames)``, written in
    full (end-of-audio is never offered: the take ends with the original's frames from the join on),
    or a ``RequestError`` naming the limit. Only the frames after ``start`` are generated, so only
    they are charged to ``max_new_tokens``."""
    budget = min(end + window, frames)
    if prompt_len + 2 * budget > context:
        raise RequestError(
            f"The repaint needs {prompt_len} prompt tokens plus {2 * budget} audio tokens up to its last "
            f"possible join, more than the model's context of {context} tokens (max_sequence_length)."
        )
    if 2 * (budget - start) > max_new_tokens:
        raise RequestError(
            f"The repaint writes up to {2 * (budget - start)} new tokens, more than this worker's "
            f"budget of {max_new_tokens} (max_new_tokens); repaint a shorter part."
        )
    return LengthPlan(budget, budget, 2 * budget)
