"""Super-resolution stage: 62 non-causal passes over the [seq, C] grid fill q2..q63.

Grid rows: the text prompt in column 0, then one row per audio frame holding q0..q(c-1) as
vocabulary ids (level c uses ids [T + c·1024, T + (c+1)·1024)). For each level the task marker
T − 1 − c (reference: 128255 − c) replaces the last text position, the network runs with a
padding-only mask, and the audio rows' hidden states are projected onto level c's rows only.
Songs longer than the model's context run in consecutive windows with the same prompt.
"""

from __future__ import annotations

import torch

from songserve.pipeline.context import TaskContext
from songserve.pipeline.gpt import AcousticGPT, full_mask
from songserve.pipeline.sampling import sample

CODEBOOK = 1024


class SuperRes:
    def __init__(self, gpt: AcousticGPT) -> None:
        self.gpt = gpt
        self.text_vocab = gpt.arch.text_vocab_size
        self.levels = (gpt.arch.vocab_size - self.text_vocab) // CODEBOOK  # 64

    @torch.inference_mode()
    def generate(
        self,
        prompt: list[int],
        coarse: torch.Tensor,  # (2, frames)
        *,
        top_k: int,
        generator: torch.Generator,
        ctx: TaskContext,
    ) -> torch.Tensor:
        """Returns codes (levels, frames)."""
        frames = coarse.shape[1]
        window = self.gpt.arch.max_sequence_length - len(prompt)
        if window <= 0:
            raise ValueError("the super-resolution prompt fills the whole context")
        out = torch.empty(self.levels, frames, dtype=torch.long)
        out[:2] = coarse
        passes = self.levels - 2
        spans = [(a, min(frames, a + window)) for a in range(0, frames, window)] or [(0, 0)]
        done = 0
        for a, b in spans:
            out[:, a:b] = self._window(prompt, coarse[:, a:b], top_k, generator, ctx, done, passes * len(spans))
            done += passes
        return out

    def _window(
        self,
        prompt: list[int],
        coarse: torch.Tensor,
        top_k: int,
        generator: torch.Generator,
        ctx: TaskContext,
        done0: int,
        total: int,
    ) -> torch.Tensor:
        """One window of frames: coarse (2, F) → codes (levels, F)."""
        gpt, dev, T = self.gpt, self.gpt.device, self.text_vocab
        P, F = len(prompt), coarse.shape[1]
        grid = torch.full((1, P + F, self.levels), -1, dtype=torch.long, device=dev)  # (B, S, C)
        grid[0, :P, 0] = torch.tensor(prompt, device=dev)
        for c in range(2):
            grid[0, P:, c] = T + c * CODEBOOK + coarse[c].to(dev)
        pos = torch.arange(P + F, device=dev).view(1, -1)
        mask = full_mask(P + F, dev)
        for c in range(2, self.levels):
            ctx.check()
            grid[0, P - 1, 0] = T - 1 - c  # task marker
            h = gpt.hidden(grid, pos, mask)[P:, 0]  # (F, H)
            start = T + c * CODEBOOK
            codes = sample(gpt.project(h, start, start + CODEBOOK), top_k, generator)  # (F,)
            grid[0, P:, c] = start + codes
            ctx.report("superres", done0 + c - 1, total, f"level {c}/{self.levels - 1}")
        return (grid[0, P:] - T - torch.arange(self.levels, device=dev) * CODEBOOK).t().cpu()
