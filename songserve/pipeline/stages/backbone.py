"""Backbone stage: autoregressive q0/q1 sampling for one take or a batch of takes of one prompt.

The backbone writes q0, q1, q0, q1, … (two tokens per audio frame). Each step projects only onto
the next token's codebook window, plus the end-of-document row once ``min_frames`` are written.

Why the loop looks like this:
- the prompt is prefilled once, in chunks with a cancellation check between them, and its KV is
  copied to every take's row; each take samples with its own seeded generator, so take *i* draws
  exactly what it would draw alone;
- the per-token work is ``DecodeModel.step`` (static shapes, position on the device) plus device
  sampling: nothing per token converts a tensor to a Python value. Every ``check_every`` tokens
  the loop synchronises once: it reads the new codes, ends rows on their end-of-audio, drops
  cancelled rows, publishes progress, and shrinks the batch to the rows still running (eager mode
  always; the compiled step when it already holds a graph for the smaller batch at the current KV
  bucket, since compiling one costs ~25 s on the CPU; CUDA graphs keep the batch: a smaller one
  would need its rows moved to the front of the shared captured cache, and on a GPU a finished
  row adds little to a step that reads the weights once for every row);
- the compiled step decodes into a cache of the model's full context, so its shapes are the same
  for every request (a cache sized to each request's length recompiled the step per length);
- a row that ended keeps drawing until that check, so its generator is rewound to the state right
  after its end-of-audio draw: the later stages see the same generator as a take run alone.

Takes on adapters (``Take.lora``: a slot of the model's ``engine/lora.py`` slots and its factor)
decode in the same batch as takes on none: the step gathers each row's delta by its slot. An
adapter changes keys and values, so the prompt is prefilled once per distinct adapter (and scale)
in the batch, into that group's first row, and copied to the group's other rows.

A retake passes the kept frames' q0/q1 codes: they are prefilled after the prompt as the
tokens the loop would have fed, written into the result as they are, and sampling starts after
them. Only such a prefill uses the KV snapshots (``engine/kv_snapshots.py``): restored positions
are not prefilled again, and the prefill is kept for the next retake of the same prefix. Snapshots
are keyed by the model's name and the take's adapter and scale, so a prefix prefilled without an
adapter is never restored for a take with one (or the reverse).

The kept frames may differ per take, at equal length (a later part of a repaint of several parts:
each take's own earlier new part is inside its prefix). The frames every take shares are prefilled
once as above (through the snapshots); the rest, each take's own, is prefilled for all rows as one
batch, since a forward over rows of equal length takes different tokens per row: one pass over the
weights for every take, not one per take. That part is never kept as a snapshot (no later request
starts with it).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from songserve.errors import RequestError, TaskCancelled, WorkerStateError
from songserve.pipeline.context import TaskContext
from songserve.pipeline.engine.decode_step import DecodeStep
from songserve.pipeline.engine.gpt import AcousticGPT
from songserve.pipeline.engine.kv_cache import KVCache
from songserve.pipeline.engine.kv_snapshots import KVSnapshots
from songserve.pipeline.engine.lora import RowLoRA, row_lora
from songserve.pipeline.engine.sampling import sample_rows
from songserve.pipeline.engine.transformer import DecodeModel
from songserve.pipeline.numbers import CODEBOOK
from songserve.pipeline.stages.length import LengthPlan
from songserve.pipeline.types import BackboneResult

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TakeLoRA:
    """A take's adapter as the step reads it: its slot, its factor ``scale·alpha/r``, and the key
    that tells its prefills apart (name, load and scale)."""

    slot: int
    coef: float
    key: str
    rank: int = 0  # the adapter's (0: read every column of the slots)


@dataclass
class Take:
    """One row of a batch: its generator (seeded per take), its task context, its adapter (None: the base model)."""

    generator: torch.Generator
    ctx: TaskContext
    lora: TakeLoRA | None = None


StepFn = Callable[..., torch.Tensor]


class TokenListener(Protocol):
    """Told of every take's new codes at each host sync (the live preview, ``pipeline/preview.py``)."""

    def tokens(self, take: int, first: int, codes: torch.Tensor) -> None:
        """``codes`` (n,) on the CPU: tokens ``first``.. of ``take`` (a take that ended may send extra)."""

    def ended(self, take: int, n_tokens: int) -> None:
        """``take`` ended with exactly ``n_tokens`` tokens (the kept ones of a retake included)."""


class Backbone:
    def __init__(
        self,
        gpt: AcousticGPT,
        eod_id: int,
        *,
        prefill_chunk: int = 512,
        check_every: int = 16,
    ) -> None:
        self.gpt = gpt
        self.eod_id = eod_id
        self.text_vocab = gpt.arch.text_vocab_size
        self.dm = DecodeModel(gpt.model, gpt.output_weight)
        self.prefill_chunk = prefill_chunk
        self.check_every = check_every
        self.compiled: DecodeStep | None = None  # set at load for a mode other than eager (DECODE_MODE)
        self.bucket = 256  # compiled step: KV lengths round up to a power of two ≥ this
        self.name = ""  # the model's name: the KV snapshots' key (set by the residency)
        self.snapshots: KVSnapshots | None = None  # retakes' prefixes (KV_SNAPSHOT_MB > 0)

    def _cache_len(self, length: int) -> int:
        """The compiled step decodes into a cache of the full context: static shapes whatever the
        request's length (no recompile per length). Eager: exactly the request's length."""
        return max(self.gpt.arch.context_length, length) if self.compiled is not None else length

    def kv_bytes_new(self, batch: int, length: int) -> int:
        """Memory a batch of ``batch`` takes decoding ``length`` positions newly takes for its KV
        cache (the worker splits a batch that would not fit)."""
        if self.compiled is not None and self.compiled.persistent:
            return self.compiled.kv_bytes_new(batch, length)
        return batch * self.dm.kv_bytes_per_take(self._cache_len(length))

    def max_frames(self, prompt_len: int) -> int:
        return max(0, (self.gpt.arch.context_length - prompt_len) // 2)

    def audio_ids(self, kept: torch.Tensor) -> list[int]:
        """Kept frames' codes (2, K) → the 2K ids the loop feeds for them: q0, q1 of each frame in turn."""
        offsets = torch.tensor([self.text_vocab, self.text_vocab + CODEBOOK]).view(2, 1)
        return [int(x) for x in (kept.long().cpu() + offsets).t().reshape(-1)]

    @torch.inference_mode()
    def prefill(
        self,
        prompt: list[int],
        cache: KVCache,
        ctxs: list[TaskContext],
        start: int = 0,
        lora: RowLoRA | None = None,
    ) -> torch.Tensor:
        """Prompt → hidden at its last position (1, H); KV written to row 0, then copied to all rows.

        Chunks of ``prefill_chunk`` tokens with a cancellation check between them; the result
        equals a one-pass prefill (same causal attention, only split over the key axis's prefix).
        ``start`` > 0: positions [0, start) are in row 0 already (a restored snapshot)."""
        dev = self.dm.device
        ids = torch.tensor(prompt, device=dev).view(1, -1)
        row0 = cache.rows(0, 1)
        h = None
        for a in range(start, len(prompt), self.prefill_chunk):
            if all(c.cancelled() for c in ctxs):
                raise TaskCancelled(f"Task {ctxs[0].task_id} was cancelled.")
            b = min(len(prompt), a + self.prefill_chunk)
            pos = torch.arange(a, b, device=dev).view(1, -1)
            h = self.dm.forward(self.dm.embed(ids[:, a:b], pos), start=a, cache=row0, lora=lora)[:, -1]
        assert h is not None
        cache.broadcast_row0(len(prompt))
        return h

    @torch.inference_mode()
    def prefill_rows(
        self, ids: torch.Tensor, cache: KVCache, start: int, ctxs: list[TaskContext], lora: RowLoRA | None = None
    ) -> torch.Tensor:
        """Each row's own tokens ``ids`` (B, S) at positions ``[start, start + S)``, after a prefix that
        every row of ``cache`` holds already → hidden at the last position (B, H).

        One forward over all rows per chunk of ``prefill_chunk`` tokens (rows of equal length, different
        tokens), with a cancellation check between chunks; ``lora``: each row's adapter."""
        dev = self.dm.device
        ids = ids.to(dev)
        h = None
        for a in range(0, int(ids.shape[1]), self.prefill_chunk):
            if all(c.cancelled() for c in ctxs):
                raise TaskCancelled(f"Task {ctxs[0].task_id} was cancelled.")
            b = min(int(ids.shape[1]), a + self.prefill_chunk)
            pos = torch.arange(start + a, start + b, device=dev).view(1, -1)
            h = self.dm.forward(self.dm.embed(ids[:, a:b], pos), start=start + a, cache=cache, lora=lora)[:, -1]
        assert h is not None, "no own tokens to prefill"
        return h

    def _prefill_kept(
        self,
        ids: list[int],
        cache: KVCache,
        ctxs: list[TaskContext],
        continues: bool,
        origin: str,
        lora: TakeLoRA | None = None,
    ) -> dict[str, Any]:
        """The prefill, through the KV snapshots when the take continues a prefix: ``h`` (1, H) and
        the metadata's ``prefill`` (tokens, restored, sec). ``lora``: the adapter every row of
        ``cache`` decodes with (the snapshots' key names it)."""
        t0 = time.perf_counter()
        snaps = self.snapshots if continues else None
        ids_t = torch.tensor(ids, dtype=torch.long)
        restored, h, task = 0, None, ctxs[0].task_id
        faults = snaps.faults if snaps is not None else 0
        model = self.name if lora is None else f"{self.name}+adapter:{lora.key}"
        rows = None if lora is None else row_lora([lora.slot], [lora.coef], self.dm.device, self.dm.dtype, [lora.rank])
        if snaps is not None:  # a fault inside the cache is a miss: the whole prefix is prefilled
            restored, came_from, h = snaps.restore(model, ids_t, cache.rows(0, 1), task)
            if restored:
                log.info(
                    "task %s: %d of %d prefix tokens restored from a KV snapshot (%s)",
                    task,
                    restored,
                    len(ids),
                    came_from or "no origin",
                )
        if h is None:
            try:
                h = self.prefill(ids, cache, ctxs, start=restored, lora=rows)
            except Exception as exc:
                if isinstance(exc, TaskCancelled) or snaps is None or snaps.faults == faults:
                    raise
                # after a fault in this worker's own cache, its state (the device's too) is suspect, not the take
                raise WorkerStateError(f"Task {task} failed on this worker after a fault in its KV snapshots.") from exc
        else:  # all of it, and its last hidden state: nothing to prefill
            cache.broadcast_row0(len(ids))
        if snaps is not None:
            snaps.save(model, ids_t, cache.rows(0, 1), origin, h, task)
        if self.dm.device.type == "cuda":
            torch.cuda.synchronize(self.dm.device)  # the seconds below are the prefill's, not its launch's
        return {"h": h, "tokens": len(ids), "restored": restored, "sec": round(time.perf_counter() - t0, 6)}

    def _kv_len(self, end: int, cache_len: int) -> tuple[int, bool]:
        """Eager: exactly the written prefix, no mask. Compiled: a power-of-two bucket with a mask."""
        if self.compiled is None:
            return end, False
        n = self.bucket
        while n < end:
            n *= 2
        return min(n, cache_len), True

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
        """One take with a budget of ``frames``; end-of-audio from ``min_share`` of it."""
        budget = min(frames, self.max_frames(len(prompt)))
        plan = LengthPlan(budget, math.ceil(min_share * budget), 2 * budget)
        result = self.generate_batch(
            prompt, plan, [Take(generator, ctx)], top_k=top_k, temperature=temperature, top_p=top_p
        )[0]
        if result is None:
            raise TaskCancelled(f"Task {ctx.task_id} was cancelled.")
        return result

    @torch.inference_mode()
    def generate_batch(
        self,
        prompt: list[int],
        plan: LengthPlan,
        takes: list[Take],
        *,
        top_k: int,
        temperature: float,
        top_p: float | None = None,
        kept: torch.Tensor | None = None,
        origin: str = "",
        listener: TokenListener | None = None,
    ) -> list[BackboneResult | None]:
        """N takes of one prompt as one batch; ``None`` for a take cancelled on its own.

        ``kept`` (2, K): a retake's kept frames, which every take starts with, or (N, 2, K): each
        take's own; ``origin`` labels the KV snapshot of what they share. ``listener`` hears each
        take's new codes at every host sync."""
        dm, P = self.dm, len(prompt)
        total = 2 * min(plan.budget_frames, self.max_frames(P))
        B = len(takes)
        own: torch.Tensor | None = None  # (B, 2, K − shared): each take's kept frames after the shared ones
        every = None if kept is None else kept.expand(B, -1, -1) if kept.dim() == 2 else kept  # (B, 2, K)
        if every is not None:
            shared = shared_frames(every)
            kept = every[0, :, :shared]
            if shared < every.shape[2]:
                own = every[:, :, shared:]
        kept_ids = self.audio_ids(kept) if kept is not None else []
        t_first = 0 if every is None else 2 * int(every.shape[2])  # the first token sampled here
        t_shared = len(kept_ids)
        if t_first >= total:
            raise RequestError(
                f"The kept part ({t_first // 2} frames) leaves nothing to generate within the song's "
                f"{total // 2} frames; ask for a longer duration or continue from an earlier point."
            )
        if self.compiled is not None and self.compiled.persistent:  # graphs read the captured cache's addresses
            cache = self.compiled.cache_for(B, P + total)
        else:
            cache = dm.new_cache(B, self._cache_len(P + total))
        dm.rope_tables(P + total)
        dev = dm.device
        prefills: list[dict[str, Any]] = [{} for _ in takes]
        groups = _adapter_groups(takes)
        group_h: list[torch.Tensor] = []
        for members in groups:  # one prefill per distinct adapter, copied to its other rows
            r0, lora0 = members[0], takes[members[0]].lora
            ctxs = [takes[r].ctx for r in members]
            got = self._prefill_kept(prompt + kept_ids, cache.rows(r0, r0 + 1), ctxs, kept is not None, origin, lora0)
            cache.copy_row(r0, members[1:], P + t_shared)
            group_h.append(got.pop("h"))
            for r in members:
                prefills[r] = got
        if len(groups) == 1:
            h = group_h[0].expand(B, -1)
        else:
            where = {r: g for g, members in enumerate(groups) for r in members}
            h = torch.cat([group_h[where[r]] for r in range(B)])
        lora = _row_lora(takes, list(range(B)), dm)
        if own is not None:  # each take's own kept frames: one batched prefill after the shared ones
            t_own = time.perf_counter()
            ids = torch.stack([torch.tensor(self.audio_ids(own[r]), dtype=torch.long) for r in range(B)])
            h = self.prefill_rows(ids, cache, P + t_shared, [x.ctx for x in takes], lora)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            sec = round(time.perf_counter() - t_own, 6)
            prefills = [{**got, "own_tokens": int(ids.shape[1]), "own_sec": sec} for got in prefills]
        picked = dm.pick_lora(lora) if self.compiled is None else None  # eager: the rows' halves once a batch

        rows = list(range(B))  # original take index of each active row
        slots = list(range(B))  # its row in h and the cache (compiled mode keeps ended rows' slots)
        results: list[BackboneResult | None] = [None] * B
        buf = torch.zeros(max(total, 1), B, dtype=torch.long, device=dev)  # codes, column = take
        if every is not None and t_first:  # q0, q1 of each kept frame in turn, a column per take
            buf[:t_first] = every.transpose(1, 2).reshape(B, t_first).t().to(dev, torch.long)
        rows_t = torch.arange(B, device=dev)
        slots_t = rows_t
        pos = torch.tensor([P + t_first], device=dev)
        saved: dict[int, list[torch.Tensor]] = {}  # step → generator states after an end-of-audio-able draw
        last_check, t0 = t_first, time.perf_counter()
        step_fn: StepFn = self.compiled or dm.step
        sampler = self.compiled.sampler if self.compiled is not None and top_p is None else None

        def finish(i: int, n_codes: int, stopped_by: str) -> None:
            if listener is not None:
                listener.ended(i, n_codes)
            codes = buf[:n_codes, i].to("cpu")
            grid = codes.view(-1, 2).t().contiguous() if n_codes else torch.zeros(2, 0, dtype=torch.long)
            results[i] = BackboneResult(grid, P, n_codes - t_first, stopped_by, dict(prefills[i]))

        t = t_first
        while t < total and rows:
            level = t % 2
            start = self.text_vocab + level * CODEBOOK
            full = len(slots) == h.shape[0]
            hs = h if full else h.index_select(0, slots_t)
            eod_allowed = level == 0 and t // 2 >= plan.min_frames
            gens = [takes[r].generator for r in rows]
            if sampler is not None:  # fused: projection, top-k and the draw in one kernel
                code = sampler(hs, start, self.eod_id if eod_allowed else None, top_k, gens, temperature)
            else:
                logits = self.gpt.project(hs, start, start + CODEBOOK)
                if eod_allowed:
                    logits = torch.cat([logits, self.gpt.project(hs, self.eod_id, self.eod_id + 1)], dim=-1)
                code = sample_rows(logits, top_k, gens, temperature, top_p)  # (b,) on the device
            buf[t].index_copy_(0, rows_t, code)
            if eod_allowed:
                saved[t] = [g.get_state() for g in gens]
            last = t + 1 == total
            if not last:
                step_in = start + code.clamp(max=CODEBOOK - 1)  # a row that just ended feeds any valid id
                if not full:
                    step_in = torch.full((h.shape[0],), start, device=dev).index_copy_(0, slots_t, step_in)
                kv_len, masked = self._kv_len(P + t + 1, cache.length)
                if picked is not None:
                    h = dm.step(step_in, pos, cache.k, cache.v, kv_len, masked, lora, picked)
                else:
                    h = step_fn(step_in, pos, cache.k, cache.v, kv_len, masked, lora)
                pos += 1
            t += 1
            if t - last_check >= self.check_every or last:
                h, cache, rows, slots = self._check(
                    takes,
                    rows,
                    slots,
                    buf,
                    last_check,
                    t,
                    saved,
                    finish,
                    h,
                    cache,
                    plan,
                    t0,
                    last,
                    P,
                    t_first,
                    listener,
                    -1 if lora is None else lora.rank,
                )
                rows_t, slots_t = _long(rows, dev), _long(slots, dev)
                if lora is not None and lora.slot.shape[0] != h.shape[0]:  # the batch shrank to ``rows``
                    lora = _row_lora(takes, rows, dm)
                    picked = dm.pick_lora(lora) if self.compiled is None else None
                saved.clear()
                last_check = t
        for i in rows:  # budget reached
            finish(i, total, "budget")
        return results

    def _check(
        self,
        takes: list[Take],
        rows: list[int],
        slots: list[int],
        buf: torch.Tensor,
        a: int,
        t: int,
        saved: dict[int, list[torch.Tensor]],
        finish: Callable[[int, int, str], None],
        h: torch.Tensor,
        cache: KVCache,
        plan: LengthPlan,
        t0: float,
        last: bool,
        prompt_len: int,
        first: int = 0,
        listener: TokenListener | None = None,
        rank: int = -1,  # the batch's adapters' rank bucket (-1: none): which compiled shapes it runs
    ) -> tuple[torch.Tensor, KVCache, list[int], list[int]]:
        """The periodic host sync: end rows on end-of-audio, drop cancelled rows, report, shrink."""
        block = buf[a:t].index_select(1, _long(rows, buf.device)).to("cpu")  # the one sync per check
        if listener is not None:
            for j, i in enumerate(rows):
                listener.tokens(i, a, block[:, j])
        keep: list[int] = []
        for j, i in enumerate(rows):
            hits = (block[:, j] == CODEBOOK).nonzero()
            if len(hits):
                step = a + int(hits[0, 0])
                takes[i].generator.set_state(saved[step][j])  # as if it had stopped right there
                finish(i, step, "end_of_audio")
                log.info("task %s: end of audio after %d tokens", takes[i].ctx.task_id, step)
            elif takes[i].ctx.cancelled():
                log.info("task %s: cancelled in the backbone at token %d", takes[i].ctx.task_id, t)
            else:
                keep.append(j)
        rate = (t - first) / max(time.perf_counter() - t0, 1e-9)  # tokens sampled here per second
        for j in keep:
            takes[rows[j]].ctx.report(
                "backbone",
                min(t, plan.estimate_tokens),
                plan.estimate_tokens,
                f"{t}/{plan.estimate_tokens} tokens",  # exactly the reference's "N/M tokens"
                rate=round(rate, 1),
            )
        new_rows = [rows[j] for j in keep]
        if len(keep) == len(rows) or not new_rows or last:
            return h, cache, new_rows, [slots[j] for j in keep]
        if self._can_shrink(len(keep), prompt_len + t + 1, cache.length, rank):  # finished rows stop costing
            kept_slots = [slots[j] for j in keep]
            idx = _long(kept_slots, h.device)
            return h.index_select(0, idx), cache.keep_rows(kept_slots), new_rows, list(range(len(keep)))
        # keep the batch shape (its graph); ended rows cost the tail but are never read
        return h, cache, new_rows, [slots[j] for j in keep]

    def _can_shrink(self, rows: int, end: int, cache_len: int, rank: int = -1) -> bool:
        """Eager: always. The compiled step: when it holds a graph for ``rows`` at the next step's KV
        bucket already (a smaller batch is a new shape). CUDA graphs: never (see the module docstring)."""
        if self.compiled is None:
            return True
        return self.compiled.can_shrink(rows, self._kv_len(end, cache_len)[0], rank)


def shared_frames(kept: torch.Tensor) -> int:
    """How many leading frames of ``kept`` (B, 2, K) every row has alike."""
    differ = (kept != kept[:1]).any(dim=1).any(dim=0).nonzero()  # frames where some row differs
    return int(differ[0, 0]) if differ.numel() else int(kept.shape[2])


def _adapter_groups(takes: list[Take]) -> list[list[int]]:
    """The rows of each distinct adapter (and scale), in order of first appearance; one group when
    every take reads the same (none included)."""
    groups: dict[str, list[int]] = {}
    for i, t in enumerate(takes):
        groups.setdefault(t.lora.key if t.lora is not None else "", []).append(i)
    return list(groups.values())


def _row_lora(takes: list[Take], rows: list[int], dm: DecodeModel) -> RowLoRA | None:
    loras = [takes[r].lora for r in rows]
    slots = [x.slot if x is not None else 0 for x in loras]
    coefs = [x.coef if x is not None else 0.0 for x in loras]
    return row_lora(slots, coefs, dm.device, dm.dtype, [x.rank if x is not None else 0 for x in loras])


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)
