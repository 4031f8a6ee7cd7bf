"""Backbone stage: autoregressive q0/q1 sampling with a KV cache.

The backbone writes q0, q1, q0, q1, … (two tokens per audio frame). Each step projects only onto
the next token's codebook window, plus the end-of-document row once ``min_share`` of the frame
budget is written, so the requested length is honoured. Per-token cost is one query position
against the cache: it does not grow with the sequence beyond attention itself.
"""

from __future__ import annotations

import math
import time

import torch

from songserve.pipeline.context import TaskContext
from songserve.pipeline.gpt import AcousticGPT, causal_mask
from songserve.pipeline.sampling import sample
from songserve.pipeline.types import BackboneResult

CODEBOOK = 1024


class Backbone:
    def __init__(self, gpt: AcousticGPT, eod_id: int) -> None:
        self.gpt = gpt
        self.eod_id = eod_id
        self.text_vocab = gpt.arch.text_vocab_size

    def max_frames(self, prompt_len: int) -> int:
        return max(0, (self.gpt.arch.max_sequence_length - prompt_len) // 2)

    @torch.inference_mode()
    def generate(
        self,
        prompt: list[int],
        frames: int,
        *,
        top_k: int,
        temperature: float,
        generator: torch.Generator,
        ctx: TaskContext,
        min_share: float = 0.9,
        top_p: float | None = None,
    ) -> BackboneResult:
        gpt, dev = self.gpt, self.gpt.device
        budget = min(frames, self.max_frames(len(prompt)))
        min_frames = math.ceil(min_share * budget)
        total = 2 * budget
        cache = gpt.new_kv_context(len(prompt) + total)
        ids = torch.tensor(prompt, device=dev).view(1, -1, 1)
        pos = torch.arange(len(prompt), device=dev).view(1, -1)
        h = gpt.hidden(ids, pos, causal_mask(len(prompt), dev), cache)[-1]  # (B, H)
        cache.increment_sequence_len_offset(len(prompt))

        codes: list[int] = []
        stopped_by, t0 = "budget", time.perf_counter()
        for t in range(total):
            ctx.check()
            level = t % 2
            start = self.text_vocab + level * CODEBOOK
            logits = gpt.project(h, start, start + CODEBOOK)  # (B, 1024)
            eod_allowed = level == 0 and len(codes) // 2 >= min_frames
            if eod_allowed:
                logits = torch.cat([logits, gpt.project(h, self.eod_id, self.eod_id + 1)], dim=-1)
            code = int(sample(logits, top_k, generator, temperature, top_p)[0])
            if code == CODEBOOK:  # the appended end-of-document row
                stopped_by = "end_of_audio"
                break
            codes.append(code)
            if t % 16 == 0 or t + 1 == total:  # progress for /health; formatting every token costs
                rate = (t + 1) / max(time.perf_counter() - t0, 1e-9)
                ctx.report("backbone", t + 1, total, f"{rate:.0f} tok/s · {t + 1} tokens")
            if t + 1 == total:
                break
            step = torch.tensor([[[start + code]]], device=dev)
            h = gpt.hidden(step, torch.tensor([[len(prompt) + t]], device=dev), None, cache)[-1]
            cache.increment_sequence_len_offset(1)
        grid = torch.tensor(codes, dtype=torch.long).view(-1, 2).t().contiguous()  # (2, frames)
        return BackboneResult(grid, len(prompt), len(codes), stopped_by)
