"""The model pipeline for one request's takes: prompt → backbone → super-resolution → decoder → files.

Tokenizer and backbone stay resident. In ``one_shot`` mode super-resolution and decoder are loaded
for each request and released afterwards; in ``keep_loaded`` mode they stay; in ``park`` mode they
wait in (pinned, on CUDA) host memory and move to the device only for their stage. All model work
runs on the worker's single model thread, under ``torch.inference_mode``. Several takes of one
request run as one batch (``run_batch``); ``run`` is a batch of one.

Park mode as a state machine over ``parked`` (the stages whose weights are in host memory now):
idle and during the backbone ``{superres, decoder}``; during superres ``{decoder}``, during the
decoder ``{superres}``, each plus ``backbone`` when ``PARK_BACKBONE`` parks it for those two
stages (``1``; ``auto``: when the device's free memory is short of what they need). However a
batch ends (done, cancelled, failed mid-stage), the state returns to idle's. Every move swaps
the ``.data`` of the same parameter objects (models, decode functions and tests keep their
references) and the host copy is kept, so parking is free and unparking is one host→device
copy; on the CPU both are no-ops and the outputs are keep_loaded's. The backbone's captured
CUDA graphs read the old addresses: they are dropped at a park and captured again on first use.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from songserve.errors import ConfigError, RequestError, TaskCancelled
from songserve.pipeline.checkpoints.gpt_load import load_model
from songserve.pipeline.checkpoints.layout import CheckpointSet
from songserve.pipeline.config import PipelineConfig
from songserve.pipeline.context import TaskContext
from songserve.pipeline.engine.arch import GPTArch
from songserve.pipeline.engine.compiled_step import CompiledStep, want_compile
from songserve.pipeline.engine.gpt import AcousticGPT
from songserve.pipeline.engine.graphed_step import GraphedStep
from songserve.pipeline.numbers import BACKBONE_LEVELS, CODEBOOK, SUPERRES_LEVELS, TOKENS_PER_MINUTE
from songserve.pipeline.stages import tokenizer as tk
from songserve.pipeline.stages.backbone import Backbone, LengthPlan, Take, plan_length
from songserve.pipeline.stages.codec import AudioDecoder, DecoderConfig, load_decoder
from songserve.pipeline.stages.export import Mp3Options, write_track
from songserve.pipeline.stages.prompt import PromptRequest, build_prompt, style_of
from songserve.pipeline.stages.superres import SuperRes
from songserve.pipeline.types import BackboneResult, TrackRequest, TrackResult

log = logging.getLogger(__name__)


def release_memory(device: torch.device) -> None:
    """Return freed memory to the system: the CUDA cache, and glibc's heap on the CPU."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    else:
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass


def _arch_summary(a: GPTArch) -> dict[str, Any]:
    return {
        "layers": a.num_layers,
        "hidden": a.hidden_size,
        "heads": a.num_attention_heads,
        "query_groups": a.num_query_groups or a.num_attention_heads,
        "position_embedding": a.position_embedding_type,
        "normalization": f"{a.normalization} eps={a.norm_epsilon:g}",
        "vocab": a.vocab_size,
        "padded_vocab": a.rows,
        "text_vocab": a.text_vocab_size,
    }


class ModelPipeline:
    def __init__(self, settings: PipelineConfig, ckpt: CheckpointSet, device: torch.device) -> None:
        self.s = settings
        self.ckpt = ckpt
        self.device = device
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.tokenizer: tk.TextTokenizer | None = None
        self.backbones: dict[str, Backbone] = {}
        self.superres: dict[str, SuperRes] = {}
        self.decoder: AudioDecoder | None = None
        self.decoder_cfg = DecoderConfig()
        self.load_sec: dict[str, float] = {}
        self._superres_arch: dict[str, GPTArch] = {}
        self.parked: set[str] = set()  # park mode: stages whose weights wait in host memory now
        self._host: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # park: tensor → its host copy
        self.phase_hook: Callable[[str], None] = lambda phase: (
            None
        )  # set by the runtime: loading phases show in /health

    # -- lifecycle ------------------------------------------------------------------------------
    def load(self) -> None:
        """Load what stays resident; validate everything else once, so start-up fails early."""
        if self.s.park_backbone == "1" and self.s.runtime_mode != "park":
            raise ConfigError(
                f"PARK_BACKBONE=1 parks the backbone in park mode only; RUNTIME_MODE is {self.s.runtime_mode}."
            )
        self.phase_hook("loading_backbone")
        self.tokenizer = tk.load_tokenizer(self.ckpt.tokenizer)
        eod = self.tokenizer.token_id(tk.EOD)
        t0 = time.perf_counter()
        for name, path in self.ckpt.backbones.items():
            self.backbones[name] = Backbone(self._gpt(path, "backbone", name), eod, prefill_chunk=self.s.prefill_chunk)
        self.load_sec["backbone"] = round(time.perf_counter() - t0, 3)
        self._load_stage2()
        assert self.decoder is not None
        self.decoder_cfg = self.decoder.cfg  # rates and frame size, kept when one_shot unloads the decoder
        self._superres_arch = {n: sr.gpt.arch for n, sr in self.superres.items()}
        if self.s.runtime_mode == "one_shot":
            self._unload_stage2()
        if self.s.runtime_mode == "park":
            self._park("superres")
            self._park("decoder")
            if self.s.park_backbone != "0":
                self._host_copy("backbone")  # now, at load: parking it later costs nothing
        if want_compile(self.s.compile, self.device):
            self.phase_hook("compiling")
            for bb in self.backbones.values():
                step: CompiledStep | GraphedStep
                if self.device.type == "cuda":  # CUDA graphs captured by hand over the step
                    step = GraphedStep(bb.dm, bb.gpt.arch.context_length)
                    step.warm(sorted({1, self.s.max_batch}), [bb.bucket])
                else:  # the backbone decodes into caches of its full context (static shapes)
                    step = CompiledStep(bb.dm)
                    step.warm(sorted({1, self.s.max_batch}), [bb.bucket], bb.gpt.arch.context_length)
                bb.compiled = None if step.failed else step

    # -- park mode: stage weights wait in host memory ---------------------------------------------
    def _modules(self, stage: str) -> list[torch.nn.Module]:
        if stage == "backbone":
            return [bb.gpt.model for bb in self.backbones.values()]
        if stage == "superres":
            return [sr.gpt.model for sr in self.superres.values()]
        return [self.decoder] if self.decoder is not None else []

    def _host_copy(self, stage: str) -> None:
        """The stage's host copy (pinned on CUDA; on the CPU the tensors themselves), made once and kept."""
        if stage not in self._host:
            tensors = [t for m in self._modules(stage) for t in (*m.parameters(), *m.buffers())]
            pin = self.device.type == "cuda"
            self._host[stage] = [(t, t.data.to("cpu").pin_memory() if pin else t.data.to("cpu")) for t in tensors]

    def _park(self, stage: str) -> None:
        """Weights back to their host copy: parking costs nothing, unparking is one host→device copy."""
        if self.s.runtime_mode != "park" or stage in self.parked:
            return
        self._host_copy(stage)
        for t, host in self._host[stage]:
            t.data = host
        self._retarget(stage, torch.device("cpu"))
        self.parked.add(stage)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _unpark(self, stage: str) -> None:
        if stage not in self.parked:
            return
        for t, host in self._host[stage]:
            t.data = host.to(self.device, non_blocking=True)
        self._retarget(stage, self.device)
        self.parked.discard(stage)

    def _retarget(self, stage: str, device: torch.device) -> None:
        """Cached device fields follow the weights (the parameter objects themselves are kept)."""
        if stage == "superres":
            for sr in self.superres.values():
                sr.gpt.device = sr.dm.device = device
                sr.dm._rope_cos = sr.dm._rope_sin = None  # rebuilt on the next use, where the weights are
        if stage == "backbone":
            for bb in self.backbones.values():
                bb.gpt.device = bb.dm.device = device
                # RoPE tables moved, not rebuilt: on the CPU the very same tensors (a compiled step's guards hold)
                if bb.dm._rope_cos is not None and bb.dm._rope_sin is not None:
                    bb.dm._rope_cos = bb.dm._rope_cos.to(device)
                    bb.dm._rope_sin = bb.dm._rope_sin.to(device)
                if isinstance(bb.compiled, GraphedStep):
                    bb.compiled.reset()  # its graphs and persistent cache hold the old addresses

    def _backbone_must_park(self, superres: SuperRes, takes: int, seq: int) -> bool:
        """PARK_BACKBONE for this batch: ``1`` always, ``0`` never, ``auto`` when the device's free
        memory (free plus what torch's cache holds unused) is short of ``_stage2_need`` (the CPU: never)."""
        if self.s.runtime_mode != "park" or self.s.park_backbone == "0":
            return False
        if self.s.park_backbone == "1":
            return True
        if self.device.type != "cuda":
            return False
        free = torch.cuda.mem_get_info(self.device)[0]
        free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        need = self._stage2_need(superres, takes, seq)
        if free < need:
            log.info(
                "parking the backbone: %.0f MiB free, superres and decoder need ~%.0f MiB", free / 2**20, need / 2**20
            )
        return free < need

    def _stage2_need(self, superres: SuperRes, takes: int, seq: int) -> int:
        """Device bytes superres and decoder take once unparked: their weights, plus an estimate of a
        superres pass's live tensors (one layer's: x, qkv, attention out, projections ≈ 8·hidden, MLP
        ≈ 3·ffn per position, and fp32 logits over one codebook)."""
        weights = sum(h.numel() * h.element_size() for st in ("superres", "decoder") for _, h in self._host.get(st, []))
        a = superres.gpt.arch
        elt = int(superres.dm.word.element_size())
        per_position = (8 * a.hidden_size + 3 * a.ffn_hidden_size) * elt + CODEBOOK * 4
        return weights + takes * seq * per_position

    def _gpt(self, path: Path, kind: str, name: str) -> AcousticGPT:
        gpt = load_model(path, self.device, self.dtype, self.s.megatron_args, kind)
        self._check_vocab(gpt, kind, name)
        return gpt

    def _check_vocab(self, gpt: AcousticGPT, kind: str, name: str) -> None:
        """The model's text ids must be the tokenizer's: one line naming both numbers."""
        assert self.tokenizer is not None
        a, n = gpt.arch, self.tokenizer.vocab_size
        if a.text_vocab_size != n:
            levels = (a.vocab_size - a.text_vocab_size) // CODEBOOK
            raise ConfigError(
                f"{kind} {name!r}: text vocabulary {a.text_vocab_size} (vocab_size {a.vocab_size} − {levels}×{CODEBOOK}) "
                f"does not match the tokenizer's {n} ids ({self.ckpt.tokenizer})."
            )

    def _load_stage2(self) -> None:
        if not self.superres:
            self.phase_hook("loading_superres")
            t0 = time.perf_counter()
            self.superres = {n: SuperRes(self._gpt(p, "superres", n)) for n, p in self.ckpt.superres.items()}
            self.load_sec["superres"] = round(time.perf_counter() - t0, 3)
        if self.decoder is None:
            self.phase_hook("loading_decoder")
            t0 = time.perf_counter()
            self.decoder = load_decoder(
                self.ckpt.decoder_config,
                self.ckpt.decoder_checkpoint,
                self.device,
                trust_pickle=self.s.trust_checkpoint_pickle,
            )
            self.load_sec["decoder"] = round(time.perf_counter() - t0, 3)

    def _unload_stage2(self) -> None:
        """Drop every reference this object holds, then return the memory (callers drop theirs first)."""
        self.superres.clear()
        self.superres, self.decoder = {}, None
        release_memory(self.device)

    def loaded(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "backbone_loaded": bool(self.backbones),
            "superres_loaded": bool(self.superres),
            "decoder_loaded": self.decoder is not None,
            "load_sec": dict(self.load_sec),  # the latest load of each stage
        }
        if self.s.runtime_mode == "park":
            out["parked"] = sorted(self.parked)
            out["park_backbone"] = self.s.park_backbone
        compiled = [bb.compiled.describe() for bb in self.backbones.values() if bb.compiled is not None]
        out["decode_step"] = compiled[0] if compiled else {"compiled": False, "cuda_graphs": False, "graphs": []}
        return out

    def describe(self) -> dict[str, Any]:
        return {
            "backbone_models": list(self.ckpt.backbones),
            "superres_models": list(self.ckpt.superres),
            "sample_rate": self.decoder_cfg.sample_rate,
            "frame_rate": round(self.decoder_cfg.frame_rate, 2),
            "channels": self.decoder_cfg.channels,
            "tiny_checkpoints": self.ckpt.tiny,
            "checkpoint_layout": self.ckpt.layout,
            "checkpoints": dict(self.ckpt.found),
            "architectures": {n: _arch_summary(b.gpt.arch) for n, b in self.backbones.items()},
        }

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
        for name, bb in self.backbones.items():
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
        if self._superres_arch:
            out["superres_max_prompt_length"] = min(a.max_prompt_length for a in self._superres_arch.values())
        return out

    def _fit(self, n: int, kv_bytes_new: Callable[[int], int]) -> int:
        """How many takes fit one batch: MAX_BATCH, then free memory for the KV cache the batch
        would newly take (none where the CUDA graphs' persistent cache holds it): a batch is split,
        never run out of memory."""
        if self.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.device)[0]
        else:
            free = _mem_available()
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
        assert self.tokenizer is not None
        assert reqs
        assert len(reqs) == len(ctxs)
        shared = [asdict(dataclasses.replace(r, seed=0, task_id="", track_index=0)) for r in reqs]
        if any(x != shared[0] for x in shared[1:]):
            raise RequestError(
                "A batch holds takes of one request: they may differ only in seed, task_id, track_index."
            )
        req = reqs[0]
        bb_name, backbone = self._pick(self.backbones, req.backbone_name, "backbone")
        style = style_of(req.description, req.tags, req.genre)
        vocal_lang = req.language if req.superres_text_mode == "full" else ""
        bb_prompt = build_prompt(
            self.tokenizer,
            PromptRequest(style, req.lyrics, req.duration, vocal_lang, req.instrumental),
            backbone.gpt.arch.max_prompt_length,
        )
        arch = backbone.gpt.arch
        plan = plan_length(
            len(bb_prompt),
            req.duration,
            self.decoder_cfg.frame_rate,
            context=arch.context_length,
            max_new_tokens=self.s.max_new_tokens,
            min_share=self.min_share(),
        )
        length = len(bb_prompt) + 2 * plan.budget_frames
        size = self._fit(len(reqs), lambda b: backbone.kv_bytes_new(b, length))
        out: list[TrackResult | BaseException] = []
        for a in range(0, len(reqs), size):
            out += self._run_batch(reqs[a : a + size], ctxs[a : a + size], bb_name, backbone, bb_prompt, plan)
        return out

    def _run_batch(
        self,
        reqs: list[TrackRequest],
        ctxs: list[TaskContext],
        bb_name: str,
        backbone: Backbone,
        bb_prompt: list[int],
        plan: LengthPlan,
    ) -> list[TrackResult | BaseException]:
        assert self.tokenizer is not None
        req, B = reqs[0], len(reqs)
        timings: dict[str, float] = {}
        t_all = time.perf_counter()
        gens = [torch.Generator(device=self.device).manual_seed(r.seed) for r in reqs]
        takes = [Take(g, c) for g, c in zip(gens, ctxs, strict=True)]
        ids = ",".join(r.task_id for r in reqs)

        t = time.perf_counter()
        bbs = backbone.generate_batch(bb_prompt, plan, takes, top_k=req.top_k_bb, temperature=req.temperature)
        timings["backbone_sec"] = time.perf_counter() - t
        for r, bb in zip(reqs, bbs, strict=True):
            if bb is not None:
                log.info("task %s: backbone %d tokens (%s), batch of %d", r.task_id, bb.new_tokens, bb.stopped_by, B)
        live = [i for i, bb in enumerate(bbs) if bb is not None]
        results: list[TrackResult | BaseException] = [TaskCancelled(f"Task {r.task_id} was cancelled.") for r in reqs]
        if not live:
            return results

        superres: SuperRes | None = None
        parked_during = {"backbone": sorted(self.parked)}  # park mode: the state each stage ran in
        try:
            t = time.perf_counter()
            self._load_stage2()
            sr_name, superres = self._pick(self.superres, req.superres_name, "superres")
            sr_style = style_of("" if req.superres_text_mode != "full" else req.description, req.tags, req.genre)
            sr_prompt = build_prompt(
                self.tokenizer,
                PromptRequest(sr_style, req.lyrics, req.duration, vocal_lang_of(req), req.instrumental),
                superres.gpt.arch.max_prompt_length,
            )
            frames = max(got.codes.shape[1] for got in bbs if got is not None)
            seq = min(superres.gpt.arch.context_length, len(sr_prompt) + frames)
            if self._backbone_must_park(superres, len(live), seq):
                self._park("backbone")
            self._unpark("superres")
            timings["load_sec"] = time.perf_counter() - t
            parked_during["superres"] = sorted(self.parked)
            t = time.perf_counter()
            for i in live:
                ctxs[i].report("superres", 0, SUPERRES_LEVELS - BACKBONE_LEVELS)
            coarse = []
            for i in live:
                got = bbs[i]
                assert got is not None
                coarse.append(got.codes)
            codes_list = superres.generate_batch(
                sr_prompt, coarse, top_k=req.top_k_sr, generators=[gens[i] for i in live], ctxs=[ctxs[i] for i in live]
            )
            timings["superres_sec"] = time.perf_counter() - t
            self._park("superres")
            t = time.perf_counter()
            self._unpark("decoder")
            timings["load_sec"] += time.perf_counter() - t
            parked_during["decoder"] = sorted(self.parked)
            for i, codes in zip(live, codes_list, strict=True):
                bb = bbs[i]
                assert bb is not None
                if ctxs[i].cancelled():
                    continue
                try:
                    results[i] = self._finish_take(
                        reqs[i],
                        ctxs[i],
                        codes,
                        bb,
                        dict(timings),
                        t_all,
                        B,
                        bb_name,
                        sr_name,
                        len(sr_prompt),
                        dict(parked_during) if self.s.runtime_mode == "park" else None,
                    )
                except TaskCancelled as exc:
                    results[i] = exc
            self._park("decoder")
        finally:  # park mode, however the batch ended (a cancel or an error mid-stage): back to idle's state
            self._park("superres")
            self._park("decoder")
            self._unpark("backbone")
            if self.s.runtime_mode == "one_shot":
                superres = None  # this frame's reference would keep the model alive through the release
                self._unload_stage2()
        log.info("tasks %s: batch of %d done in %.2fs", ids, B, time.perf_counter() - t_all)
        return results

    def _finish_take(
        self,
        req: TrackRequest,
        ctx: TaskContext,
        codes: torch.Tensor,
        bb: BackboneResult,
        timings: dict[str, float],
        t_all: float,
        batch_size: int,
        bb_name: str,
        sr_name: str,
        sr_prompt_len: int,
        parked: dict[str, list[str]] | None = None,
    ) -> TrackResult:
        """Decoder and files for one take of a batch."""
        t = time.perf_counter()
        assert self.decoder is not None
        cfg = self.decoder.cfg
        ctx.report("decoding", 0, 1)

        def on_chunk(done: int, total: int) -> None:
            ctx.check()
            ctx.report("decoding", done, total, f"chunk {done}/{total}")

        with torch.inference_mode():
            wave = self.decoder.decode(
                codes[: cfg.n_codebooks].unsqueeze(0).to(self.device),
                self.s.decode_chunk_frames,
                self.s.decode_context_frames,
                on_chunk,
            )[0]
        audio = wave.float().t().cpu().numpy()  # (samples, channels)
        timings["decoder_sec"] = time.perf_counter() - t
        duration_sec = audio.shape[0] / cfg.sample_rate
        metadata = {
            "task_id": req.task_id,
            "job_id": req.job_id,
            "track_index": req.track_index,
            "request": {k: v for k, v in asdict(req).items() if k not in ("task_id", "job_id", "track_index")},
            "seed": req.seed,
            "models": {"backbone": bb_name, "superres": sr_name, "tiny_checkpoints": self.ckpt.tiny},
            "tokens": {
                "backbone_prompt": bb.prompt_tokens,
                "backbone_new": bb.new_tokens,
                "superres_prompt": sr_prompt_len,
                "frames": int(codes.shape[1]),
                "stopped_by": bb.stopped_by,
            },
            "stopped_by": bb.stopped_by,
            "batch_size": batch_size,
            "timings": timings,
            "duration_sec": duration_sec,
            "requested_sec": req.duration * 60,
            "sample_rate": cfg.sample_rate,
            "channels": int(audio.shape[1]),
            "device": str(self.device),
            "runtime_mode": self.s.runtime_mode,
            "load_sec": dict(self.load_sec),
        }
        if parked is not None:  # park mode: which stages waited in host memory while each stage ran
            metadata["parked"] = parked
        ctx.report("decoding", 1, 1, "writing files")
        mp3 = Mp3Options(self.s.mp3_bitrate_mode, self.s.mp3_compression_level)
        timings["model_sec"] = time.perf_counter() - t_all
        wav, mp3_name, meta, metadata = write_track(self.s.output_dir, audio, cfg.sample_rate, metadata, mp3)
        log.info(
            "task %s: wrote %s (%.2fs audio) in %.2fs", req.task_id, wav, duration_sec, time.perf_counter() - t_all
        )
        return TrackResult(wav, mp3_name, meta, duration_sec, bb.new_tokens, req.seed, metadata)


def vocal_lang_of(req: TrackRequest) -> str:
    return req.language if req.superres_text_mode == "full" else ""


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
