"""Preview audio while the backbone writes: a window of super-resolution, the decoder, PCM out.

The backbone hands every batch of new q0/q1 tokens to a ``Previewer`` (its ``TokenListener``) at
its periodic host sync. Nothing more happens until someone wants a take's live audio
(``LiveAudio.want``: the request's ``preview``, or a listener on the worker's stream route); then
the previewer's own thread starts and, whenever a wanted take has ``chunk_frames`` new frames:

1. **super-resolution over a window** (of the first ``levels``, ``PREVIEW_LEVELS``: by default all
   64; fewer is a cheaper, coarser preview, its levels those a full pass draws, an RVQ decoded from
   its first levels): the new frames' q0/q1 plus ``context_frames`` frames
   before them whose 64 levels the preview already has, passed as known values (the retake's
   mechanism, ``SuperRes.generate_batch(known=…)``): the window is non-causal inside, and the
   preview grid stays one consistent grid across windows;
2. **the decoder** over the new part of that grid with ``decode_context`` frames of context on
   each side (chunked decoding with ≥ 12 frames of context is exact, ``stages/codec.py``): the
   last ``decode_context`` frames wait for the next window, so the joins need no crossfade and
   the preview is exactly the decode of its own grid;
3. the PCM is appended to the take's ``LiveAudio`` file.

Why a thread of its own: the backbone never waits for a preview. If the previewer falls behind, it
takes every frame that is ready in one larger window (fewer, bigger windows: less overhead), and
on CUDA it runs on its own stream beside the backbone's steps. It draws with a generator of its
own (seeded from the take's seed), so the final files are exactly what they are without a
listener; the final super-resolution and decoder still run over the whole song as before.

``close`` (the backbone returned) flushes what the wanted takes still lack and joins the thread;
a take first wanted after the backbone ended is ``missed`` (its final audio follows soon). A
failure here is logged and fails the live audio only, never the take.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

from songserve.errors import TaskCancelled
from songserve.pipeline.context import TaskContext
from songserve.pipeline.engine.lora import RowLoRA
from songserve.pipeline.numbers import BACKBONE_LEVELS
from songserve.pipeline.stages.codec import AudioDecoder
from songserve.pipeline.stages.superres import SuperRes

log = logging.getLogger(__name__)
PREVIEW_SEED = 0x5EED_1DEA  # mixed into a take's seed: the preview never draws from the take's generator
WAIT_SEC = 0.05  # how often the idle preview thread looks for wanted takes


@dataclass(frozen=True)
class PreviewStages:
    """What a preview runs: super-resolution with its prompt, and the decoder (loaded on first use);
    ``loras``: a take's adapter in super-resolution, by task id (as its final pass reads it)."""

    superres: SuperRes
    prompt: list[int]
    decoder: AudioDecoder
    loras: dict[str, RowLoRA] = field(default_factory=dict[str, RowLoRA])


class _Follow(TaskContext):
    """The preview's super-resolution cancels with its take but reports to nobody (the take's own
    progress stays the backbone's)."""

    def __init__(self, take: TaskContext) -> None:
        super().__init__(take.task_id)
        self.take = take

    def cancelled(self) -> bool:
        return self.take.cancelled()

    def check(self) -> None:
        self.take.check()

    def report(self, phase: str, done: int, total: int, detail: str = "", rate: float | None = None) -> None:
        pass


@dataclass
class _Row:
    ctx: TaskContext
    seed: int
    flat: torch.Tensor  # (2 · budget,) backbone codes by token index (q0, q1, q0, …), CPU
    n_tokens: int = 0  # tokens of ``flat`` that are real
    ended: bool = False  # the backbone will write no more for this take
    grid: torch.Tensor | None = None  # (64, F) the preview's codes so far
    emitted: int = 0  # frames whose audio is in the live file
    generator: torch.Generator | None = None
    windows: list[float] = field(default_factory=list)  # seconds each window took

    @property
    def ready(self) -> int:
        return self.n_tokens // 2

    @property
    def done(self) -> int:
        return 0 if self.grid is None else int(self.grid.shape[1])


class Previewer:
    """One batch's live audio (see the module docstring); the backbone's ``TokenListener``."""

    def __init__(
        self,
        ctxs: list[TaskContext],
        seeds: list[int],
        budget_frames: int,
        stages: Callable[[], PreviewStages],
        *,
        out_dir: Path,
        device: torch.device,
        chunk_frames: int,
        context_frames: int,
        decode_context: int,
        top_k: int,
        decode_chunk: int = 256,  # DECODE_CHUNK_FRAMES: a long window decodes in chunks, as the final does
        kept: torch.Tensor | None = None,  # (64, K): a retake's kept frames, the start of every take
        levels: int = 0,  # code levels the preview fills and decodes (PREVIEW_LEVELS); 0 = all
    ) -> None:
        self.rows = [
            _Row(c, s, torch.zeros(2 * budget_frames, dtype=torch.long)) for c, s in zip(ctxs, seeds, strict=True)
        ]
        self.kept = kept
        if kept is not None:
            for row in self.rows:
                row.flat[: 2 * kept.shape[1]] = kept[:BACKBONE_LEVELS].t().reshape(-1)
                row.n_tokens = 2 * int(kept.shape[1])
        self._stages_of = stages
        self.out_dir = out_dir
        self.device = device
        self.chunk = max(1, chunk_frames)
        self.context = max(0, context_frames)
        self.decode_context = max(0, decode_context)
        self.decode_chunk = decode_chunk
        self.top_k = top_k
        self.levels = levels
        self.enabled = chunk_frames > 0  # PREVIEW_CHUNK_SEC=0: no live audio on this worker
        self.threads = torch.get_num_threads()  # the model thread's: a new thread would take OpenMP's default
        self._cond = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None

    # -- the model thread: the backbone's TokenListener -------------------------------------------
    def tokens(self, take: int, first: int, codes: torch.Tensor) -> None:
        """New backbone codes of ``take`` from token ``first`` on (CPU); a take past its end sends extra."""
        row = self.rows[take]
        if row.ended or not self.enabled:
            return
        end = min(first + int(codes.shape[0]), row.flat.shape[0])
        row.flat[first:end] = codes[: end - first]
        with self._cond:
            row.n_tokens = max(row.n_tokens, end)
            self._cond.notify()
        if self._thread is None and any(r.ctx.live.wanted() for r in self.rows):
            self._start()

    def ended(self, take: int, n_tokens: int) -> None:
        """``take`` has exactly ``n_tokens`` tokens (its end of audio, or its budget)."""
        row = self.rows[take]
        with self._cond:
            row.n_tokens, row.ended = n_tokens, True
            self._cond.notify()

    def close(self, failed: str = "") -> None:
        """The backbone returned: flush the wanted takes (or, after a failure, stop), then join."""
        with self._cond:
            self._closing = True
            for row in self.rows:
                row.ended = True  # a cancelled take gets no more tokens either
            if failed:
                for row in self.rows:
                    row.ctx.live.fail(failed)
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
        for row in self.rows:
            row.ctx.live.close_window()

    def report(self, take: int) -> dict[str, object] | None:
        """For a take's metadata: how its live audio went (None when nobody wanted it)."""
        row = self.rows[take]
        live = row.ctx.live
        if not live.wanted():
            return None
        return {
            "state": live.state.value,
            "seconds": round(live.seconds, 3),
            "windows": len(row.windows),
            "sec": round(sum(row.windows), 3),
        }

    # -- the preview thread -----------------------------------------------------------------------
    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="preview", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        torch.set_num_threads(self.threads)  # CPU: beside the backbone, not all cores spinning against it
        stream = None
        if self.device.type == "cuda":  # a stream of its own: its kernels run beside the backbone's steps
            torch.cuda.set_device(self.device)
            stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        try:
            with torch.inference_mode(), torch.cuda.stream(stream) if stream is not None else nullcontext():
                stages = self._stages_of()
                while True:
                    row = self._next()
                    if row is None:
                        return
                    try:
                        self._advance(row, stages)
                    except TaskCancelled:  # its take was cancelled mid-window: the other takes go on
                        row.ctx.live.fail("the take was cancelled")
        except Exception as exc:  # the take goes on; only its live audio ends
            log.exception("live audio of tasks %s failed", ",".join(r.ctx.task_id for r in self.rows))
            for row in self.rows:
                row.ctx.live.fail(f"the preview failed: {type(exc).__name__}")

    def _next(self) -> _Row | None:
        """The next take with work, waiting for one; None once closing and nothing is left to do."""
        with self._cond:
            while True:
                for row in self.rows:
                    if self._has_work(row):
                        return row
                if self._closing:
                    return None
                self._cond.wait(WAIT_SEC)

    def _has_work(self, row: _Row) -> bool:
        live = row.ctx.live
        if not live.wanted() or live.state.final:
            return False
        if row.ctx.cancelled():
            live.fail("the take was cancelled")
            return False
        if row.ended:
            return True  # the rest, then complete
        return row.ready - row.done >= self.chunk

    def _advance(self, row: _Row, stages: PreviewStages) -> None:
        t0 = time.perf_counter()
        live = row.ctx.live
        if row.grid is None:
            live.open(self.out_dir)
            row.grid = (
                self.kept.clone() if self.kept is not None else torch.zeros(stages.superres.levels, 0, dtype=torch.long)
            )
            row.generator = torch.Generator(self.device).manual_seed((row.seed ^ PREVIEW_SEED) & (2**63 - 1))
        with self._cond:
            ready, ended = row.ready, row.ended
        if ready > row.done:
            self._superres(row, stages, ready)
        self._decode(row, stages.decoder, final=ended)
        row.windows.append(time.perf_counter() - t0)
        if ended:
            live.complete()
            log.info(
                "task %s: live audio complete, %.1f s in %d windows (%.2f s)",
                row.ctx.task_id,
                live.seconds,
                len(row.windows),
                sum(row.windows),
            )

    def _superres(self, row: _Row, stages: PreviewStages, ready: int) -> None:
        assert row.grid is not None
        assert row.generator is not None
        done = row.done
        left = min(self.context, done)
        coarse = row.flat[: 2 * ready].view(-1, 2).t()[:, done - left :]  # (2, left + new)
        known = row.grid[:, done - left :] if left else None
        got = stages.superres.generate_batch(
            stages.prompt,
            [coarse],
            top_k=self.top_k,
            generators=[row.generator],
            ctxs=[_Follow(row.ctx)],
            known=known,
            upto=self.levels,
            lora=stages.loras.get(row.ctx.task_id),
        )[0]
        row.grid = torch.cat([row.grid, got[:, left:]], dim=1)

    def _decode(self, row: _Row, decoder: AudioDecoder, final: bool) -> None:
        """The audio of frames ``[emitted, end)``: all of them at the end, else all but the last
        ``decode_context`` (their right context is not written yet)."""
        assert row.grid is not None
        frames = row.done
        end = frames if final else frames - self.decode_context
        if end <= row.emitted:
            return
        lo, hi = max(0, row.emitted - self.decode_context), min(frames, end + self.decode_context)
        cfg = decoder.cfg
        levels = min(self.levels or cfg.n_codebooks, cfg.n_codebooks)  # RVQ: the first levels are a coarser take
        codes = row.grid[:levels, lo:hi].unsqueeze(0).to(self.device)
        wave = decoder.decode(codes, self.decode_chunk, self.decode_context)[0]  # (channels, samples): exact
        a, b = (row.emitted - lo) * cfg.hop, (end - lo) * cfg.hop
        row.ctx.live.append(wave[:, a:b].float().t().cpu().numpy())
        row.emitted = end
