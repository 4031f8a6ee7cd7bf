"""Where a repaint rejoins its original: the join frame, chosen from the coarse codes alone.

A repaint writes a take's frames anew from ``start`` and must hand back to the original near ``end``.
Cutting at ``end`` exactly puts whatever the backbone happened to write there next to the original's
next frame; a join ``j`` a few frames either side, where the new take and the original are alike
around ``j``, makes the seam the decoder has to bridge a small one. For each candidate ``j`` the
score is the mean distance between the new and the original frames ``[j − RADIUS, j + RADIUS)``
(those the new take wrote): the frames on either side of the seam, one of which is dropped from
each source. Lower is better; ties go to the frame closest to ``end``, then to the earlier one.

The distance is taken between what the decoder hears of the two coarse levels: the sum of their
codebook vectors, the first two terms of the residual quantizer's latent (``coarse_tables``).
Equal codes would be the cheaper test, but two independent draws of a frame's pair of codes out of
1024² almost never agree, so that score is flat and the join would always be ``end``; the latent
distance is graded (two different codes can be close), and it costs two table lookups per frame.
Without tables (``tables=None``) the distance is the share of the two codes that differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from songserve.pipeline.stages.codec import AudioDecoder, Codebook

RADIUS = 2  # frames on each side of a candidate join that its score compares


@dataclass(frozen=True)
class Join:
    """The chosen join frame, its score, and the score of joining at ``end`` exactly (lower is better)."""

    frame: int
    score: float
    end_score: float


def join_range(start: int, end: int, window: int, frames: int, floor: int = 0) -> tuple[int, int]:
    """The candidate joins, inclusive: within ``window`` of ``end``, after ``start``, at or after ``floor``
    (an opening's placeholder frames), inside the grid."""
    return max(start + 1, end - window, floor), min(end + window, frames)


def coarse_tables(decoder: AudioDecoder) -> torch.Tensor:
    """The decoder's codebook vectors of levels 0 and 1 as latents: (2, codebook, latent_dim) float32 on the CPU."""
    out = []
    for level in range(2):
        q: Codebook = decoder.quantizer.quantizers[level]  # type: ignore[assignment]
        e = q.codebook.weight.detach().float()  # (codebook, dim)
        if q.out_proj is not None:  # factorised codes: the 1×1 convolution up to the latent
            e = e @ q.out_proj.weight.detach().float()[:, :, 0].t()  # (codebook, latent)
            if q.out_proj.bias is not None:
                e = e + q.out_proj.bias.detach().float()
        out.append(e.cpu())
    return torch.stack(out)


def choose_join(
    original: torch.Tensor,  # (2, F): the original's coarse codes
    new: torch.Tensor,  # (2, N): the new take's coarse codes, written over [start, N) at least
    start: int,
    end: int,
    window: int,
    tables: torch.Tensor | None = None,  # (2, codebook, latent): ``coarse_tables``
    floor: int = 0,  # an opening: the original's frames before it are placeholders, never joined or compared
) -> Join:
    """The join frame in ``join_range`` where the new codes best continue into the original's."""
    frames = int(original.shape[1])
    written = int(new.shape[1])
    lo, hi = join_range(start, end, window, frames, floor)
    if not start < end <= frames:
        raise ValueError(f"repaint {start}..{end} is not a part of a grid of {frames} frames")
    if written < hi:
        raise ValueError(f"the new take has {written} frames; a join up to frame {hi} needs them all")
    a, b = max(start, floor, lo - RADIUS), min(written, frames, hi + RADIUS)
    dist = _distance(original[:, a:b], new[:, a:b], tables)  # (b − a,): per frame

    def score(j: int) -> float:
        f0, f1 = max(a, j - RADIUS), min(b, j + RADIUS)
        return float(dist[f0 - a : f1 - a].mean())

    scores = {j: score(j) for j in range(lo, hi + 1)}
    best = min(scores, key=lambda j: (scores[j], abs(j - end), j))
    return Join(best, scores[best], scores[end])


def _distance(x: torch.Tensor, y: torch.Tensor, tables: torch.Tensor | None) -> torch.Tensor:
    """Per frame, how far apart two frames' coarse codes are: latent distance, or the share of codes that differ."""
    if tables is None:
        return (x != y).double().mean(dim=0)
    lx = tables[0][x[0].long()] + tables[1][x[1].long()]  # (frames, latent)
    ly = tables[0][y[0].long()] + tables[1][y[1].long()]
    gap: torch.Tensor = (lx - ly).double().norm(dim=1)
    return gap
