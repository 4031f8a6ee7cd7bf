"""Super-resolution stage: 62 non-causal passes over the [seq, C] grid fill q2..q63.

Grid rows: the text prompt in column 0, then one row per audio frame holding q0..q(c-1) as
vocabulary ids (level c uses ids [T + c·1024, T + (c+1)·1024)). For each level the task marker
T − 1 − c (reference: 128255 − c) replaces the last text position, the network runs all-visible,
and the audio rows' hidden states are projected onto level c's rows only. Songs longer than the
model's context run in consecutive windows with the same prompt.

Several takes of one prompt run as one batch: rows of different lengths are padded
with ``-1`` and their padding keys masked; a batch of equal lengths runs with no mask at all. Each
take samples its own frames with its own generator, exactly the draws it makes alone.

A retake passes the kept frames' 64 levels (``known``): at each level's pass they are
written into the grid as known values and only the new frames' cells are sampled, so the network
still sees the whole grid (non-causal) with levels 0..c-1 filled everywhere, as in a take of its
own. A window of kept frames only is copied, not run.

A repaint passes the whole grid as ``known`` and per take the spans of frames it writes anew
(``spans``: one per part): every cell outside them is known, levels 0..63, on both sides of each
span. Only windows that hold frames of a span run, and they are placed around it (``repaint_windows``)
so the new frames see the original's frames after them as well as before them. A window samples every
frame of any span in it that no window before sampled, so spans close together share a window.
"""

from __future__ import annotations

import torch

from songserve.pipeline.context import TaskContext
from songserve.pipeline.engine.gpt import AcousticGPT
from songserve.pipeline.engine.lora import RowLoRA
from songserve.pipeline.engine.sampling import sample
from songserve.pipeline.engine.transformer import DecodeModel
from songserve.pipeline.numbers import CODEBOOK


class SuperRes:
    def __init__(self, gpt: AcousticGPT) -> None:
        self.gpt = gpt
        self.dm = DecodeModel(gpt.model, gpt.output_weight)
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
        return self.generate_batch(prompt, [coarse], top_k=top_k, generators=[generator], ctxs=[ctx])[0]

    @torch.inference_mode()
    def generate_batch(
        self,
        prompt: list[int],
        coarse: list[torch.Tensor],  # per take (2, frames_i)
        *,
        top_k: int,
        generators: list[torch.Generator],
        ctxs: list[TaskContext],
        known: torch.Tensor | None = None,  # (levels, K): every take's first K frames, kept as they are
        upto: int = 0,  # fill levels [0, upto) only (a live preview's cheaper grid); 0 = all of them
        spans: list[list[tuple[int, int]]] | None = None,  # per take the frames [s, j) of each part written anew;
        # known is the whole grid
        span_context: int = 0,  # with spans: frames of context on each side of a span in its window; 0 = a whole window
        lora: RowLoRA | None = None,  # each take's adapter (``engine/lora.py``); None: the base model
    ) -> list[torch.Tensor]:
        """Per take codes (levels, frames_i). A take whose context is cancelled stops the batch only
        when every take is cancelled; its codes are then simply not used by the caller. With ``upto``
        the levels from ``upto`` on are not sampled (their rows are meaningless), and the levels below
        are the ones a full pass draws: each pass sees only the levels below its own."""
        top = min(upto or self.levels, self.levels)
        window = self.gpt.arch.context_length - len(prompt)
        if window <= 0:
            raise ValueError("the super-resolution prompt fills the whole context")
        if spans is not None:
            assert known is not None, "a repaint's spans need the grid they are spans of"
            return self._repaint(prompt, coarse, top_k, generators, ctxs, known, spans, window, top, span_context, lora)
        kept = 0 if known is None else int(known.shape[1])
        if known is not None and int(known.shape[0]) != self.levels:
            raise ValueError(f"the kept frames have {known.shape[0]} levels; this model writes {self.levels}")
        outs = []
        for c in coarse:
            out = torch.empty(self.levels, c.shape[1], dtype=torch.long)
            out[:2] = c
            if known is not None:
                out[:, :kept] = known[:, : c.shape[1]]
            outs.append(out)
        longest = max(c.shape[1] for c in coarse)
        windows = [(a, min(longest, a + window)) for a in range(0, longest, window)] or [(0, 0)]
        passes = top - 2
        for w, (a, b) in enumerate(windows):
            members = [i for i, c in enumerate(coarse) if c.shape[1] > a or (a == 0 and c.shape[1] == 0)]
            parts = [coarse[i][:, a:b] for i in members]
            known_here = None if known is None else known[:, a : min(b, kept)]
            if known_here is not None and all(p.shape[1] <= known_here.shape[1] for p in parts):
                continue  # every frame of this window is kept: nothing to sample (``outs`` holds them)
            got = self._window(
                prompt,
                parts,
                top_k,
                [generators[i] for i in members],
                [ctxs[i] for i in members],
                w * passes,
                passes * len(windows),
                known_here,
                top,
                lora=None if lora is None else lora.select(torch.tensor(members, device=self.dm.device)),
            )
            for i, codes in zip(members, got, strict=True):
                outs[i][:, a : a + codes.shape[1]] = codes
        return outs

    def _repaint(
        self,
        prompt: list[int],
        coarse: list[torch.Tensor],  # per take (2, F): the original's coarse codes outside its spans
        top_k: int,
        generators: list[torch.Generator],
        ctxs: list[TaskContext],
        known: torch.Tensor,  # (levels, F): the original grid
        spans: list[list[tuple[int, int]]],  # per take its spans, in order, apart
        window: int,
        top: int,
        span_context: int = 0,
        lora: RowLoRA | None = None,  # each take's adapter
    ) -> list[torch.Tensor]:
        """Each take's spans sampled in the windows ``repaint_windows`` places around each; all else is ``known``.

        With ``span_context`` a window holds at most its span and that many frames on each side of it,
        so a short repaint of a long take costs a short window, not the model's whole one.

        The takes' k-th windows run as one batch (a take's rows start where its own window does:
        the positions are the window's own, as in any window), and what a window samples is known
        to the take's next one (``span_windows``)."""
        if int(known.shape[0]) != self.levels:
            raise ValueError(f"the grid has {known.shape[0]} levels; this model writes {self.levels}")
        outs = []
        for c, take in zip(coarse, spans, strict=True):
            for s, j in take:
                if int(c.shape[1]) != int(known.shape[1]) or not 0 <= s <= j <= int(c.shape[1]):
                    raise ValueError(
                        f"a repaint span {s}..{j} of a take of {c.shape[1]} frames and a grid of {known.shape[1]}"
                    )
            out = known.clone()
            out[:2] = c
            outs.append(out)
        plans = [
            span_windows(take, int(c.shape[1]), window, span_context) for c, take in zip(coarse, spans, strict=True)
        ]
        rounds = max((len(p) for p in plans), default=0)
        passes = top - 2
        for w in range(rounds):
            members = [i for i, p in enumerate(plans) if len(p) > w]
            rows, fresh, kept = [], [], []
            for i in members:
                a, b, ranges = plans[i][w]
                rows.append(outs[i][:2, a:b])
                fresh.append([(lo - a, hi - a) for lo, hi in ranges])
                kept.append(outs[i][:, a:b])
            got = self._window(
                prompt,
                rows,
                top_k,
                [generators[i] for i in members],
                [ctxs[i] for i in members],
                w * passes,
                passes * rounds,
                top=top,
                fresh=fresh,
                around=kept,
                lora=None if lora is None else lora.select(torch.tensor(members, device=self.dm.device)),
            )
            for i, codes in zip(members, got, strict=True):
                a, _, ranges = plans[i][w]
                for lo, hi in ranges:
                    outs[i][2:, lo:hi] = codes[2:, lo - a : hi - a]
        return outs

    def _window(
        self,
        prompt: list[int],
        coarse: list[torch.Tensor],
        top_k: int,
        generators: list[torch.Generator],
        ctxs: list[TaskContext],
        done0: int,
        total: int,
        known: torch.Tensor | None = None,  # (levels, k): the window's first k frames, kept
        top: int = 0,  # levels [0, top) are filled
        fresh: list[list[tuple[int, int]]] | None = None,  # per row the frames [lo, hi) sampled; the rest ``around``
        around: list[torch.Tensor] | None = None,  # per row (levels, F_i): the known cells outside its fresh frames
        lora: RowLoRA | None = None,  # the rows' adapters
    ) -> list[torch.Tensor]:
        """One window: per row coarse (2, F_i) → codes (levels, F_i)."""
        dm, dev, T = self.dm, self.dm.device, self.text_vocab
        P, B = len(prompt), len(coarse)
        lens = [c.shape[1] for c in coarse]
        k = 0 if known is None else int(known.shape[1])
        kept = None if known is None else known.to(dev)
        F = max(lens)
        grid = torch.full((B, P + F, self.levels), -1, dtype=torch.long, device=dev)  # (B, S, C)
        grid[:, :P, 0] = torch.tensor(prompt, device=dev)
        for r, rows in enumerate(coarse):
            for lvl in range(2):
                grid[r, P : P + lens[r], lvl] = T + lvl * CODEBOOK + rows[lvl].to(dev)
        pos = torch.arange(P + F, device=dev).view(1, -1).expand(B, -1)
        padding = None
        if min(lens) != F:  # rows of different lengths: mask the padding keys
            padding = torch.arange(P + F, device=dev).view(1, -1) >= torch.tensor(
                [P + n for n in lens], device=dev
            ).view(-1, 1)
        for c in range(2, top or self.levels):
            if all(x.cancelled() for x in ctxs):
                ctxs[0].check()
            grid[:, P - 1, 0] = T - 1 - c  # task marker
            h = dm.forward(dm.embed(grid, pos), causal=False, key_padding=padding, lora=lora)[:, P:]  # (B, F, H)
            start = T + c * CODEBOOK
            if fresh is not None and around is not None:  # a repaint's rows: known on both sides of each [lo, hi)
                for r, (ranges, cells) in enumerate(zip(fresh, around, strict=True)):
                    new = torch.zeros(lens[r], dtype=torch.bool)
                    for lo, hi in ranges:
                        new[lo:hi] = True
                    at = new.nonzero()[:, 0]  # the frames sampled, in order: one draw over all of them
                    grid[r, P : P + lens[r], c] = start + cells[c, : lens[r]].to(dev)
                    if at.numel():
                        at = at.to(dev)
                        logits = self.gpt.project(h[r].index_select(0, at), start, start + CODEBOOK)
                        grid[r, P + at, c] = start + sample(logits, top_k, generators[r])
            else:
                for r in range(B):
                    if k and lens[r] <= k:
                        continue  # a take that ended right where the kept frames end samples nothing
                    logits = self.gpt.project(h[r, k : lens[r]], start, start + CODEBOOK)
                    grid[r, P + k : P + lens[r], c] = start + sample(logits, top_k, generators[r])
                if kept is not None:
                    grid[:, P : P + k, c] = start + kept[c]
            for x in ctxs:
                x.report("superres", done0 + c - 1, total, f"level {c}/{self.levels - 1}")
        levels = torch.arange(self.levels, device=dev) * CODEBOOK
        return [(grid[r, P : P + lens[r]] - T - levels).t().cpu() for r in range(B)]


def span_windows(
    spans: list[tuple[int, int]], frames: int, window: int, span_context: int = 0
) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """The windows ``(a, b, ranges)`` that sample a take's spans, in order: each span's ``repaint_windows``
    (at most the span and ``span_context`` frames each side, when that is > 0), each sampling the frames
    ``ranges`` of every span in it that no window before sampled; a window left nothing to sample (an
    earlier span's window sampled all of its span) is dropped."""
    done = [s for s, _ in spans]  # per span: sampled up to this frame (a span is sampled left to right)
    out = []
    for s, j in spans:
        size = min(window, j - s + 2 * span_context) if span_context > 0 else window
        for a, b in repaint_windows(s, j, frames, size):
            ranges = []
            for k, (_, end) in enumerate(spans):
                hi = min(b, end)
                if a <= done[k] < hi:
                    ranges.append((done[k], hi))
                    done[k] = hi
            if ranges:
                out.append((a, b, ranges))
    return out


def repaint_windows(start: int, join: int, frames: int, window: int) -> list[tuple[int, int]]:
    """The windows ``[a, b)`` that sample a repaint's frames ``[start, join)`` of a ``frames``-frame grid.

    Each window samples the span's frames in it that no window before sampled, and sees every other
    frame in it as known. A span that fits one window gets one, centred on it (moved inside the grid),
    so the original's frames on both sides are in view. A longer one is walked left to right: each
    window starts a quarter window before the first frame it samples (the frames sampled just before
    are its left context), until what is left fits a window with a quarter window of the original on
    its right too; that last one is centred on what is left."""
    if join <= start:
        return []
    if frames <= window:
        return [(0, frames)]
    margin = window // 4
    out: list[tuple[int, int]] = []
    done = start
    while True:
        left = join - done
        if left <= window - 2 * margin or (not out and left <= window):
            a = min(max(0, done - (window - left) // 2), frames - window)
            out.append((a, a + window))
            return out
        a = min(max(0, done - margin), frames - window)
        out.append((a, a + window))
        done = min(a + window, join)
        if done >= join:
            return out
