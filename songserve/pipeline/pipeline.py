"""The model pipeline for one request's takes: prompt → backbone → super-resolution → decoder → files.

Orchestration only: which models a request picks, its prompts and length plan, how many takes
run as one batch, the stages in order, the track's metadata and files. Where the stages' weights
are (``RUNTIME_MODE``, park mode's state machine) is ``residency.py``'s; each batch walks its
transitions. All model work runs on the worker's single model thread, under
``torch.inference_mode``. Several takes of one request run as one batch (``run_batch``); ``run``
is a batch of one. A retake (a request with a ``prefix``) keeps the prefix's frames and generates
the rest (``continuation.py``), through the KV snapshots this pipeline keeps for the backbones. A
repaint (a prefix with a ``repaint`` span) is a retake at the span's start with a fixed length,
rejoined to the original at a join near the span's end (``stages/join.py``); super-resolution then
fills only the new frames, with the original's cells known on both sides. Its live preview starts
from the kept frames before the span, like a retake's, and plays the backbone's new frames as written.
A repaint of several parts does that part by part, in order: each later part continues from the
take's coarse codes so far (its own new parts before it are in its prefix, so the prefix differs per
take: the shared frames are prefilled once, each take's own in one batched pass, ``stages/backbone.py``)
and picks its own join; super-resolution then fills every new span in one pass over the grid. The
live preview plays the first part.
Each take may name a LoRA adapter of ``ADAPTERS_DIR`` and its scale (``adapters/``): the takes of
one batch may name different ones, and each take's metadata records the one it used.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import IO, Any

import torch

from songserve.errors import RequestError, TaskCancelled
from songserve.pipeline.adapters.residency import AdapterStore, Resident, install, model_shape
from songserve.pipeline.checkpoints.layout import CheckpointSet
from songserve.pipeline.config import PipelineConfig
from songserve.pipeline.context import TaskContext
from songserve.pipeline.continuation import kept_codes, prefix_grid, splice
from songserve.pipeline.encoding import encode_audio
from songserve.pipeline.engine.decode_step import DecodeStep, choose_mode
from songserve.pipeline.engine.kv_snapshots import KVSnapshots
from songserve.pipeline.engine.lora import RowLoRA, row_lora
from songserve.pipeline.engine.transformer import DecodeModel
from songserve.pipeline.finish import BatchFacts, finish_take
from songserve.pipeline.live_audio.previewer import Previewer, PreviewStages
from songserve.pipeline.numbers import BACKBONE_LEVELS, SUPERRES_LEVELS, TOKENS_PER_MINUTE
from songserve.pipeline.residency import Residency, mem_available
from songserve.pipeline.stages.backbone import Backbone, Take, TakeLoRA
from songserve.pipeline.stages.codec import AudioDecoder
from songserve.pipeline.stages.join import Join, choose_join, coarse_tables
from songserve.pipeline.stages.kept_audio import KeptAudio
from songserve.pipeline.stages.length import LengthPlan, plan_length, plan_repaint
from songserve.pipeline.stages.prompt import PromptRequest, build_prompt, style_of
from songserve.pipeline.stages.superres import SuperRes
from songserve.pipeline.types import BackboneResult, EncodeResult, Repaint, TrackRequest, TrackResult

log = logging.getLogger(__name__)
CPU_PREVIEW_LEVELS = 16  # PREVIEW_LEVELS' default on the CPU (bench P14)


class ModelPipeline:
    def __init__(self, settings: PipelineConfig, ckpt: CheckpointSet, device: torch.device) -> None:
        self.s = settings
        self.ckpt = ckpt
        self.device = device
        self.residency = Residency(settings, ckpt, device, phase=self._phase)
        self.snapshots = KVSnapshots(int(settings.kv_snapshot_mb * 2**20), settings.kv_snapshot_memory)
        self.kept_audio = KeptAudio(int(settings.edit_audio_mb * 2**20))  # what an edit decodes against
        self.adapters: AdapterStore | None = None  # made at load, when the models' shapes are known
        self.phase_hook: Callable[[str], None] = lambda phase: (
            None
        )  # set by the runtime: loading phases show in /health

    def _phase(self, phase: str) -> None:
        self.phase_hook(phase)  # looked up at each call: the runtime sets phase_hook after construction

    # -- lifecycle ------------------------------------------------------------------------------
    def load(self) -> None:
        """Load what stays resident (``Residency.load``), then compile the backbones' decode step."""
        self.residency.load()
        for name, bb in self.residency.backbones.items():
            bb.name = name
            bb.snapshots = self.snapshots if self.snapshots.capacity > 0 else None
        self.adapters = self._adapter_store()
        mode = choose_mode(self.s.decode_mode, self.s.compile, self.device)
        if mode != "eager":
            self.phase_hook("compiling")
            for bb in self.residency.backbones.values():
                context = bb.gpt.arch.context_length  # the step's static cache length
                step = DecodeStep(bb.dm, mode, context)
                step.warm(sorted({1, self.s.max_batch}), [bb.bucket], context)
                bb.compiled = None if step.failed else step

    def loaded(self) -> dict[str, Any]:
        out = self.residency.status()
        compiled = [bb.compiled.describe() for bb in self.residency.backbones.values() if bb.compiled is not None]
        out["decode_step"] = (
            compiled[0] if compiled else {"mode": "eager", "compiled": False, "cuda_graphs": False, "graphs": []}
        )
        out["kv_snapshots"] = self.snapshots.describe()
        out["kept_audio"] = self.kept_audio.describe()
        if self.adapters is not None:
            out["adapters"] = self.adapters.describe()
        return out

    def _adapter_store(self) -> AdapterStore:
        """The adapters this worker may load: shaped for its first backbone and super-resolution, and
        trained on a model this set answers to (a model's name, its folder's, or the set's folder's)."""
        shapes = {}
        if self.residency.backbones:
            shapes["backbone"] = model_shape(next(iter(self.residency.backbones.values())).gpt.arch)
        if self.residency.superres_arch:
            shapes["superres"] = model_shape(next(iter(self.residency.superres_arch.values())))
        paths = [*self.ckpt.backbones.items(), *self.ckpt.superres.items()]
        names = {n for n, _ in paths} | {p.name for _, p in paths} | {p.parent.name for _, p in paths}
        return AdapterStore(self.s.adapters_dir, self.s.max_adapters, shapes, names, uploads=self.s.adapter_uploads_dir)

    def prefetch_adapters(self, names: list[str]) -> None:
        """Load the named adapters ahead of their batch, off the model thread (a failure is the batch's to report)."""
        if self.adapters is not None:
            for name in dict.fromkeys(n for n in names if n):
                self.adapters.prefetch(name)

    def _uploads(self) -> AdapterStore:
        if self.adapters is None or self.adapters.uploads is None:
            raise RequestError(
                "This worker takes no adapter uploads (its models are not loaded, or no uploads folder)."
            )
        return self.adapters

    def upload_adapter(self, name: str, config: IO[bytes], weights: IO[bytes]) -> dict[str, Any]:
        return self._uploads().upload(name, config, weights)

    def remove_adapter(self, name: str, sha256: str | None = None) -> None:
        self._uploads().remove(name, sha256)

    def _adapter_errors(self, reqs: list[TrackRequest]) -> dict[int, BaseException]:
        """The takes whose adapter cannot be loaded (unknown, refused, more than the slots), each with its error."""
        names = {r.adapter for r in reqs if r.adapter and r.adapter_scale}
        errors: dict[str, BaseException] = {}
        for name in sorted(names):
            try:
                if self.adapters is None:
                    raise RequestError("Field 'adapter': this worker serves no adapters.")
                self.adapters.get(name, keep=names, hit=False)
            except RequestError as exc:
                errors[name] = exc
        return {i: errors[r.adapter] for i, r in enumerate(reqs) if r.adapter_scale and r.adapter in errors}

    def _resolve_adapters(self, reqs: list[TrackRequest]) -> list[Resident | None]:
        """Each take's adapter, resident (loaded now if need be); None for none or scale 0."""
        names = {r.adapter for r in reqs if r.adapter and r.adapter_scale}
        if not names:
            return [None] * len(reqs)
        if self.adapters is None:
            raise RequestError("Field 'adapter': this worker serves no adapters.")
        store = self.adapters
        return [store.get(r.adapter, keep=names) if r.adapter and r.adapter_scale else None for r in reqs]

    def _take_lora(self, dm: DecodeModel, model: str, used: Resident | None, scale: float) -> TakeLoRA | None:
        """A take's adapter in ``dm``'s slots (installed if need be); None: the base model."""
        if used is None or self.adapters is None:
            return None
        factor = install(dm, used, model, self.adapters.capacity, self.adapters.max_rank)
        if not factor:
            return None
        return TakeLoRA(used.slot, scale * factor, f"{used.key}@{scale:g}", used.adapter.rank)

    def _rows_lora(
        self, dm: DecodeModel, model: str, used: list[Resident | None], reqs: list[TrackRequest]
    ) -> RowLoRA | None:
        loras = [self._take_lora(dm, model, u, r.adapter_scale) for u, r in zip(used, reqs, strict=True)]
        slots = [x.slot if x is not None else 0 for x in loras]
        coefs = [x.coef if x is not None else 0.0 for x in loras]
        return row_lora(slots, coefs, dm.device, dm.dtype, [x.rank if x is not None else 0 for x in loras])

    def describe(self) -> dict[str, Any]:
        cfg = self.residency.decoder_cfg
        return {
            "backbone_models": list(self.ckpt.backbones),
            "superres_models": list(self.ckpt.superres),
            "sample_rate": cfg.sample_rate,
            "frame_rate": round(cfg.frame_rate, 2),
            "channels": cfg.channels,
            "tiny_checkpoints": self.ckpt.tiny,
            "untrained": self.ckpt.untrained,  # seeded random weights: noise of the right length
            "checkpoint_layout": self.ckpt.layout,
            "checkpoints": dict(self.ckpt.found),
            "architectures": {n: b.gpt.arch.summary() for n, b in self.residency.backbones.items()},
            "encoder": self.residency.encoder_error is None,
        }

    def encode(self, audio: Any, ctx: TaskContext) -> EncodeResult:
        """A person's audio as codes (``encoding.py``), the encoder where ``RUNTIME_MODE`` keeps it."""
        return encode_audio(self.residency, self.s, audio, ctx)

    # -- limits, reported in /config ---------------------------------------------------------------
    def min_share(self) -> float:
        """EOA_MIN_SHARE, or its default: exact length for the tiny set, none for a real set."""
        if self.s.eoa_min_share is not None:
            return self.s.eoa_min_share
        return 1.0 if self.ckpt.untrained else 0.0

    def limits(self) -> dict[str, Any]:
        """What the dispatcher needs to refuse or pack requests before sending them."""
        out: dict[str, Any] = {"max_new_tokens": self.s.max_new_tokens, "max_batch": self.s.max_batch}
        out["eoa_min_share"] = self.min_share()
        out["tokens_per_minute"] = TOKENS_PER_MINUTE
        for name, bb in self.residency.backbones.items():
            arch = bb.gpt.arch
            ctx_len = arch.context_length
            out.setdefault("backbones", {})[name] = {
                "max_sequence_length": ctx_len,
                "max_prompt_length": arch.max_prompt_length,
                "max_new_tokens": min(self.s.max_new_tokens, ctx_len),
                "kv_bytes_per_take": bb.dm.kv_bytes_per_take(ctx_len),
            }
        first: dict[str, Any] = next(iter(out.get("backbones", {}).values()), {})
        out.update(
            {k: first[k] for k in ("max_sequence_length", "max_prompt_length", "kv_bytes_per_take") if k in first}
        )
        if self.residency.superres_arch:
            out["superres_max_prompt_length"] = min(a.max_prompt_length for a in self.residency.superres_arch.values())
        return out

    def _fit(self, n: int, kv_bytes_new: Callable[[int], int]) -> int:
        """How many takes fit one batch: MAX_BATCH, then free memory for the KV cache the batch
        would newly take (none where the CUDA graphs' persistent cache holds it): a batch is split,
        never run out of memory."""
        if self.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.device)[0]
        else:
            free = mem_available()
        size = max(1, min(n, self.s.max_batch))
        while free and size > 1 and kv_bytes_new(size) > 0.8 * free:
            size -= 1
        return size

    # -- takes --------------------------------------------------------------------------------------
    def _pick(self, table: dict[str, Any], name: str, what: str) -> tuple[str, Any]:
        if not name:
            return next(iter(table.items()))
        if name not in table:
            raise RequestError(f"Unknown {what} model {name!r}; available: {', '.join(table)}.")
        return name, table[name]

    def run(self, req: TrackRequest, ctx: TaskContext) -> TrackResult:
        out = self.run_batch([req], [ctx])[0]
        if isinstance(out, BaseException):
            raise out
        return out

    def run_batch(self, reqs: list[TrackRequest], ctxs: list[TaskContext]) -> list[TrackResult | BaseException]:
        """Several takes of one request (differing only in seed / task id / track index) as batches.

        Returns per take its result or the exception that ended it (``TaskCancelled`` when only
        that take was cancelled). A request error (bad model name, too long) raises for all."""
        tokenizer = self.residency.tokenizer
        assert tokenizer is not None
        assert reqs
        assert len(reqs) == len(ctxs)
        shared = [
            asdict(dataclasses.replace(r, seed=0, task_id="", track_index=0, adapter="", adapter_scale=0.0))
            for r in reqs
        ]
        if any(x != shared[0] for x in shared[1:]):
            raise RequestError(
                "A batch holds takes of one request: they may differ only in seed, task_id, track_index, adapter, "
                "adapter_scale."
            )
        refused = self._adapter_errors(reqs)
        if refused:  # those takes fail alone; the others run
            ok = [i for i in range(len(reqs)) if i not in refused]
            got = self.run_batch([reqs[i] for i in ok], [ctxs[i] for i in ok]) if ok else []
            done: dict[int, TrackResult | BaseException] = {**refused, **dict(zip(ok, got, strict=True))}
            return [done[i] for i in range(len(reqs))]
        req = reqs[0]
        bb_name, backbone = self._pick(self.residency.backbones, req.backbone_name, "backbone")
        style = style_of(req.description, req.tags, req.genre)
        vocal_lang = req.language if req.superres_text_mode == "full" else ""
        bb_prompt = build_prompt(
            tokenizer,
            PromptRequest(style, req.lyrics, req.duration, vocal_lang, req.instrumental),
            backbone.gpt.arch.max_prompt_length,
        )
        arch = backbone.gpt.arch
        original: torch.Tensor | None = None  # (64, F): a repaint's whole grid
        plans: list[LengthPlan] = []  # a repaint's: one per part
        if req.prefix is not None and req.prefix.repaint is not None:
            span = req.prefix.repaint
            original = prefix_grid(req.prefix, SUPERRES_LEVELS)
            plans = [
                plan_repaint(
                    len(bb_prompt),
                    part.start,
                    part.end,
                    part.window,
                    req.prefix.frames,
                    context=arch.context_length,
                    max_new_tokens=self.s.max_new_tokens,
                )
                for part in req.prefix.repaints()
            ]
            # Progress runs to the last part's end for every part: a take's position in the song only
            # moves on, part after part (each part's own end would reach 100 % and fall back).
            plans = [dataclasses.replace(p, estimate_tokens=plans[-1].estimate_tokens) for p in plans]
            plan = plans[0]
            # The token ids of a retake at start; an opening (start 0) keeps nothing: a take from the prompt.
            kept: torch.Tensor | None = original[:, : span.start] if span.start > 0 else None
        else:
            plan = plan_length(
                len(bb_prompt),
                req.duration,
                self.residency.decoder_cfg.frame_rate,
                context=arch.context_length,
                max_new_tokens=self.s.max_new_tokens,
                min_share=self.min_share(),
                kept_frames=req.prefix.frames if req.prefix is not None else 0,  # prefilled, not generated
            )
            kept = kept_codes(req.prefix, SUPERRES_LEVELS, plan.budget_frames) if req.prefix is not None else None
        length = len(bb_prompt) + 2 * max(p.budget_frames for p in [plan, *plans])
        size = self._fit(len(reqs), lambda b: backbone.kv_bytes_new(b, length))
        out: list[TrackResult | BaseException] = []
        for a in range(0, len(reqs), size):
            out += self._run_batch(
                reqs[a : a + size], ctxs[a : a + size], bb_name, backbone, bb_prompt, plan, kept, original, plans
            )
        return out

    def _run_batch(
        self,
        reqs: list[TrackRequest],
        ctxs: list[TaskContext],
        bb_name: str,
        backbone: Backbone,
        bb_prompt: list[int],
        plan: LengthPlan,
        kept: torch.Tensor | None = None,  # (64, K): a retake's kept frames
        original: torch.Tensor | None = None,  # (64, F): a repaint's whole grid (kept is its frames before the span)
        plans: list[LengthPlan] | None = None,  # a repaint's, one per part (``plan`` is the first's)
    ) -> list[TrackResult | BaseException]:
        residency, tokenizer = self.residency, self.residency.tokenizer
        assert tokenizer is not None
        req, B = reqs[0], len(reqs)
        timings: dict[str, float] = {}
        t_all = time.perf_counter()
        gens = [torch.Generator(device=self.device).manual_seed(r.seed) for r in reqs]
        used = self._resolve_adapters(reqs)
        takes = [
            Take(g, c, self._take_lora(backbone.dm, "backbone", u, r.adapter_scale))
            for g, c, u, r in zip(gens, ctxs, used, reqs, strict=True)
        ]
        ids = ",".join(r.task_id for r in reqs)

        t = time.perf_counter()
        previewer = self._previewer(reqs, ctxs, plan, kept, used)
        try:
            bbs = backbone.generate_batch(
                bb_prompt,
                plan,
                takes,
                top_k=req.top_k_bb,
                temperature=req.temperature,
                kept=None if kept is None else kept[:BACKBONE_LEVELS],
                origin=req.prefix.origin if req.prefix is not None else "",
                listener=previewer,
            )
        except BaseException as exc:
            previewer.close(failed=f"the take ended in the backbone ({type(exc).__name__})")
            raise
        previewer.close()  # the rest of each wanted take's live audio, before stage 2 takes the device
        timings["backbone_sec"] = time.perf_counter() - t
        for r, bb in zip(reqs, bbs, strict=True):
            if bb is not None:
                log.info("task %s: backbone %d tokens (%s), batch of %d", r.task_id, bb.new_tokens, bb.stopped_by, B)
        live = [i for i, bb in enumerate(bbs) if bb is not None]
        results: list[TrackResult | BaseException] = [TaskCancelled(f"Task {r.task_id} was cancelled.") for r in reqs]
        if not live:
            return results

        superres: SuperRes | None = None
        parked_during = {"backbone": sorted(residency.parked)}  # park mode: the state each stage ran in
        try:
            t = time.perf_counter()
            residency.load_stage2()
            sr_name, superres = self._pick(residency.superres, req.superres_name, "superres")
            sr_prompt = self._superres_prompt(req, superres)
            joins: list[list[Join]] = [[] for _ in live]
            spans: list[list[tuple[int, int]]] | None = None
            parts_sec = 0.0  # a repaint's later parts: the backbone's, not the loading's
            if original is not None:  # a repaint: rejoin the original part by part, then fill only the new frames
                assert req.prefix is not None
                assert residency.decoder is not None
                t_parts = time.perf_counter()
                parts = list(zip(req.prefix.repaints(), plans or [plan], strict=True))
                bbs, spans, joins = self._rejoin(
                    parts, original, bbs, live, takes, backbone, bb_prompt, req, residency.decoder
                )
                parts_sec = time.perf_counter() - t_parts
                timings["backbone_sec"] += parts_sec
                live = [i for i in live if bbs[i] is not None]  # a take cancelled in a later part is done
                if not live:
                    return results
            coarse = []
            for i in live:
                got = bbs[i]
                assert got is not None
                coarse.append(got.codes)
            frames = max(c.shape[1] for c in coarse)
            seq = min(superres.gpt.arch.context_length, len(sr_prompt) + frames)
            residency.enter_superres(superres, len(live), seq)
            timings["load_sec"] = time.perf_counter() - t - parts_sec
            parked_during["superres"] = sorted(residency.parked)
            t = time.perf_counter()
            for i in live:
                ctxs[i].report("superres", 0, SUPERRES_LEVELS - BACKBONE_LEVELS)
            codes_list = superres.generate_batch(
                sr_prompt,
                coarse,
                top_k=req.top_k_sr,
                generators=[gens[i] for i in live],
                ctxs=[ctxs[i] for i in live],
                known=kept if original is None else original,
                spans=spans,
                span_context=self.s.repaint_context_frames,
                lora=self._rows_lora(superres.dm, "superres", [used[i] for i in live], [reqs[i] for i in live]),
            )
            timings["superres_sec"] = time.perf_counter() - t
            residency.leave_superres()
            t = time.perf_counter()
            residency.enter_decoder()
            timings["load_sec"] += time.perf_counter() - t
            parked_during["decoder"] = sorted(residency.parked)
            for i, codes, join in zip(live, codes_list, joins, strict=True):
                bb = bbs[i]
                assert bb is not None
                if ctxs[i].cancelled():
                    continue
                try:
                    batch = BatchFacts(
                        B,
                        bb_name,
                        sr_name,
                        len(sr_prompt),
                        dict(timings),
                        t_all,
                        dict(parked_during) if self.s.runtime_mode == "park" else None,
                    )
                    assert residency.decoder is not None
                    results[i] = finish_take(
                        self.s,
                        self.ckpt.tiny,
                        residency,
                        self.device,
                        reqs[i],
                        ctxs[i],
                        codes,
                        bb,
                        batch,
                        previewer.report(i),
                        join,
                        adapter_of(used[i], reqs[i]),
                        self.kept_audio,
                    )
                except TaskCancelled as exc:
                    results[i] = exc
        finally:  # however the batch ended (a cancel or an error mid-stage): back to idle's state
            superres = None  # this frame's reference would keep the model alive through one_shot's release
            residency.end_batch()
        log.info("tasks %s: batch of %d done in %.2fs", ids, B, time.perf_counter() - t_all)
        return results

    def _rejoin(
        self,
        parts: list[tuple[Repaint, LengthPlan]],
        original: torch.Tensor,  # (64, F)
        bbs: list[BackboneResult | None],  # per take of the batch: the first part's backbone result
        live: list[int],
        takes: list[Take],
        backbone: Backbone,
        bb_prompt: list[int],
        req: TrackRequest,
        decoder: AudioDecoder,
    ) -> tuple[list[BackboneResult | None], list[list[tuple[int, int]]], list[list[Join]]]:
        """A repaint's takes, part by part: per take and part its join (``stages/join.py``, scored on the
        decoder's codebook latents) and its coarse codes spliced into the take's so far; the later parts
        are written by the backbone from the take's codes so far (each take its own prefix).

        Returns per take of the batch its backbone result with the spliced coarse codes (2, F) (None: a
        take cancelled), and per take still live (in ``live``'s order) the frames super-resolution fills and
        the joins."""
        tables = coarse_tables(decoder)
        out: list[BackboneResult | None] = list(bbs)
        spans: dict[int, list[tuple[int, int]]] = {i: [] for i in live}
        joins: dict[int, list[Join]] = {i: [] for i in live}
        prefills: dict[int, list[dict[str, Any]]] = {i: [] for i in live}
        for p, (part, plan) in enumerate(parts):
            alive = [i for i in live if out[i] is not None]
            if not alive:
                break
            news: list[BackboneResult | None]
            if p == 0:
                news = [out[i] for i in alive]
            else:  # from each take's codes so far: its own new parts are in its prefix
                coarse = [got.codes for got in (out[i] for i in alive) if got is not None]
                news = backbone.generate_batch(
                    bb_prompt,
                    plan,
                    [takes[i] for i in alive],
                    top_k=req.top_k_bb,
                    temperature=req.temperature,
                    kept=torch.stack([c[:, : part.start] for c in coarse]),
                    origin=req.prefix.origin if req.prefix is not None else "",
                )
            for i, new in zip(alive, news, strict=True):
                so_far = out[i]
                assert so_far is not None
                if new is None:  # cancelled in this part
                    out[i] = None
                    continue
                join = choose_join(
                    original[:BACKBONE_LEVELS], new.codes, part.start, part.end, part.window, tables, floor=part.opening
                )
                base = original if p == 0 else so_far.codes  # the take's codes so far are the original's from here
                codes = splice(base, new.codes, part.start, join.frame)
                tokens = new.new_tokens if p == 0 else so_far.new_tokens + new.new_tokens
                out[i] = dataclasses.replace(so_far, codes=codes, new_tokens=tokens)
                spans[i].append((part.start, join.frame))
                joins[i].append(join)
                prefills[i].append(new.prefill)
                log.info("task %s: repaint part %d rejoins at frame %d", takes[i].ctx.task_id, p, join.frame)
        if len(parts) > 1:  # the metadata's prefill: the first part's, and each part's
            for i in live:
                got = out[i]
                if got is not None:
                    got.prefill = {**prefills[i][0], "parts": prefills[i]}
        done = [i for i in live if out[i] is not None]
        return out, [spans[i] for i in done], [joins[i] for i in done]

    def _superres_prompt(self, req: TrackRequest, superres: SuperRes) -> list[int]:
        tokenizer = self.residency.tokenizer
        assert tokenizer is not None
        style = style_of("" if req.superres_text_mode != "full" else req.description, req.tags, req.genre)
        return build_prompt(
            tokenizer,
            PromptRequest(style, req.lyrics, req.duration, vocal_lang_of(req), req.instrumental),
            superres.gpt.arch.max_prompt_length,
        )

    def _previewer(
        self,
        reqs: list[TrackRequest],
        ctxs: list[TaskContext],
        plan: LengthPlan,
        kept: torch.Tensor | None,
        used: list[Resident | None],
    ) -> Previewer:
        """The batch's live audio (``preview.py``); it costs nothing until a take is wanted."""
        req, fps = reqs[0], self.residency.decoder_cfg.frame_rate

        def stages() -> PreviewStages:  # on the preview thread, when the first take is wanted
            self.residency.load_stage2()
            self.residency.enter_preview()
            superres = self._pick(self.residency.superres, req.superres_name, "superres")[1]
            assert self.residency.decoder is not None
            loras = {}
            for c, u, r in zip(ctxs, used, reqs, strict=True):
                lora = self._rows_lora(superres.dm, "superres", [u], [r])
                if lora is not None:
                    loras[c.task_id] = lora
            return PreviewStages(superres, self._superres_prompt(req, superres), self.residency.decoder, loras)

        chunk = round(self.s.preview_chunk_sec * fps)
        for ctx in ctxs:
            if req.preview and chunk > 0:
                ctx.live.want()
        return Previewer(
            ctxs,
            [r.seed for r in reqs],
            plan.budget_frames,
            stages,
            out_dir=self.s.output_dir,
            device=self.device,
            chunk_frames=chunk,
            context_frames=self.s.preview_context_frames,
            decode_context=self.s.decode_context_frames,
            decode_chunk=self.s.decode_chunk_frames,
            top_k=req.top_k_sr,
            kept=kept,
            levels=self.preview_levels(),
        )

    def preview_levels(self) -> int:
        """PREVIEW_LEVELS, or its default: every level on CUDA (the preview's own stream overlaps the
        backbone), 16 on the CPU (a whole second super-resolution would compete with the take for cores)."""
        if self.s.preview_levels:
            return self.s.preview_levels
        return SUPERRES_LEVELS if self.device.type == "cuda" else CPU_PREVIEW_LEVELS


def adapter_of(used: Resident | None, req: TrackRequest) -> dict[str, Any] | None:
    """A take's ``adapter`` in its metadata and codes header: name, scale and rank (None: the base model)."""
    if used is None:
        return None
    return {"name": used.adapter.name, "scale": req.adapter_scale, "rank": used.adapter.rank}


def vocal_lang_of(req: TrackRequest) -> str:
    return req.language if req.superres_text_mode == "full" else ""
