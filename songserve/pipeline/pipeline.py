"""The model pipeline for one track: prompt → backbone → super-resolution → decoder → files.

Tokenizer and backbone stay resident. In ``one_shot`` mode super-resolution and decoder are loaded
for each request and released afterwards; in ``keep_loaded`` mode they stay. All model work runs
on the worker's single model thread, under ``torch.inference_mode``.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from songserve.errors import ConfigError, RequestError
from songserve.pipeline import tokenizer as tk
from songserve.pipeline.backbone import Backbone
from songserve.pipeline.checkpoints import CheckpointSet
from songserve.pipeline.codec import Codec, CodecConfig, load_codec
from songserve.pipeline.context import TaskContext
from songserve.pipeline.export import Mp3Options, write_track
from songserve.pipeline.gpt import AcousticGPT, GPTArch, load_model
from songserve.pipeline.prompt import PromptRequest, build_prompt, style_of
from songserve.pipeline.superres import SuperRes
from songserve.pipeline.types import TrackRequest, TrackResult
from songserve.settings import WorkerSettings

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
    def __init__(self, settings: WorkerSettings, ckpt: CheckpointSet, device: torch.device) -> None:
        self.s = settings
        self.ckpt = ckpt
        self.device = device
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.tokenizer: tk.TextTokenizer | None = None
        self.backbones: dict[str, Backbone] = {}
        self.superres: dict[str, SuperRes] = {}
        self.codec: Codec | None = None
        self.codec_cfg = CodecConfig()
        self.load_sec: dict[str, float] = {}
        self.phase_hook: Callable[[str], None] = lambda phase: (
            None
        )  # set by the runtime: loading phases show in /health

    # -- lifecycle ------------------------------------------------------------------------------
    def load(self) -> None:
        """Load what stays resident; validate everything else once, so start-up fails early."""
        self.phase_hook("loading_backbone")
        self.tokenizer = tk.load_tokenizer(self.ckpt.tokenizer)
        eod = self.tokenizer.token_id(tk.EOD)
        t0 = time.perf_counter()
        for name, path in self.ckpt.backbones.items():
            self.backbones[name] = Backbone(self._gpt(path, "backbone", name), eod)
        self.load_sec["backbone"] = round(time.perf_counter() - t0, 3)
        self._load_stage2()
        assert self.codec is not None
        self.codec_cfg = self.codec.cfg  # rates and frame size, kept when one_shot unloads the codec
        if self.s.runtime_mode == "one_shot":
            self._unload_stage2()

    def _gpt(self, path: Path, kind: str, name: str) -> AcousticGPT:
        gpt = load_model(path, self.device, self.dtype, self.s.megatron_args, kind)
        self._check_vocab(gpt, kind, name)
        return gpt

    def _check_vocab(self, gpt: AcousticGPT, kind: str, name: str) -> None:
        """The model's text ids must be the tokenizer's: one line naming both numbers."""
        assert self.tokenizer is not None
        a, n = gpt.arch, self.tokenizer.vocab_size
        if a.text_vocab_size != n:
            levels = (a.vocab_size - a.text_vocab_size) // 1024
            raise ConfigError(
                f"{kind} {name!r}: text vocabulary {a.text_vocab_size} (vocab_size {a.vocab_size} − {levels}×1024) "
                f"does not match the tokenizer's {n} ids ({self.ckpt.tokenizer})."
            )

    def _load_stage2(self) -> None:
        if not self.superres:
            self.phase_hook("loading_superres")
            t0 = time.perf_counter()
            self.superres = {n: SuperRes(self._gpt(p, "superres", n)) for n, p in self.ckpt.superres.items()}
            self.load_sec["superres"] = round(time.perf_counter() - t0, 3)
        if self.codec is None:
            self.phase_hook("loading_decoder")
            t0 = time.perf_counter()
            self.codec = load_codec(
                self.ckpt.decoder_config,
                self.ckpt.decoder_checkpoint,
                self.device,
                trust_pickle=self.s.trust_checkpoint_pickle,
            )
            self.load_sec["decoder"] = round(time.perf_counter() - t0, 3)

    def _unload_stage2(self) -> None:
        """Drop every reference this object holds, then return the memory (callers drop theirs first)."""
        self.superres.clear()
        self.superres, self.codec = {}, None
        release_memory(self.device)

    def loaded(self) -> dict[str, Any]:
        return {
            "backbone_loaded": bool(self.backbones),
            "superres_loaded": bool(self.superres),
            "decoder_loaded": self.codec is not None,
            "load_sec": dict(self.load_sec),  # the latest load of each stage
        }

    def describe(self) -> dict:
        return {
            "backbone_models": list(self.ckpt.backbones),
            "superres_models": list(self.ckpt.superres),
            "sample_rate": self.codec_cfg.sample_rate,
            "frame_rate": round(self.codec_cfg.frame_rate, 2),
            "channels": self.codec_cfg.channels,
            "tiny_checkpoints": self.ckpt.tiny,
            "checkpoint_layout": self.ckpt.layout,
            "checkpoints": dict(self.ckpt.found),
            "architectures": {n: _arch_summary(b.gpt.arch) for n, b in self.backbones.items()},
        }

    # -- one track ------------------------------------------------------------------------------
    def _pick(self, table: dict[str, Any], name: str, what: str) -> tuple[str, Any]:
        if not name:
            return next(iter(table.items()))
        if name not in table:
            raise RequestError(f"Unknown {what} model {name!r}; available: {', '.join(table)}.")
        return name, table[name]

    def run(self, req: TrackRequest, ctx: TaskContext) -> TrackResult:
        assert self.tokenizer is not None
        timings: dict[str, float] = {}
        t_all = time.perf_counter()
        bb_name, backbone = self._pick(self.backbones, req.backbone_name, "backbone")
        gen = torch.Generator(device=self.device).manual_seed(req.seed)

        style = style_of(req.description, req.tags, req.genre)
        vocal_lang = req.language if req.superres_text_mode == "full" else ""
        bb_prompt = build_prompt(
            self.tokenizer,
            PromptRequest(style, req.lyrics, req.duration, vocal_lang, req.instrumental),
            backbone.gpt.arch.max_prompt_length,
        )
        frames = max(1, int(req.duration * 60 * self.codec_cfg.frame_rate))  # a hard budget: never longer than asked

        t = time.perf_counter()
        bb = backbone.generate(
            bb_prompt,
            frames,
            top_k=req.top_k_bb,
            temperature=req.temperature,
            generator=gen,
            ctx=ctx,
            min_share=self.s.eoa_min_share,
        )
        timings["backbone_sec"] = time.perf_counter() - t
        log.info(
            "task %s: backbone %d tokens (%s) in %.2fs",
            req.task_id,
            bb.new_tokens,
            bb.stopped_by,
            timings["backbone_sec"],
        )

        superres: SuperRes | None = None
        try:
            t = time.perf_counter()
            self._load_stage2()
            timings["load_sec"] = time.perf_counter() - t
            sr_name, superres = self._pick(self.superres, req.superres_name, "superres")
            sr_style = style_of("" if req.superres_text_mode != "full" else req.description, req.tags, req.genre)
            sr_prompt = build_prompt(
                self.tokenizer,
                PromptRequest(sr_style, req.lyrics, req.duration, vocal_lang, req.instrumental),
                superres.gpt.arch.max_prompt_length,
            )
            t = time.perf_counter()
            ctx.report("superres", 0, 62)
            codes = superres.generate(sr_prompt, bb.codes, top_k=req.top_k_sr, generator=gen, ctx=ctx)
            timings["superres_sec"] = time.perf_counter() - t

            t = time.perf_counter()
            assert self.codec is not None
            cfg = self.codec.cfg
            ctx.report("decoding", 0, 1)

            def on_chunk(done: int, total: int) -> None:
                ctx.check()
                ctx.report("decoding", done, total, f"chunk {done}/{total}")

            with torch.inference_mode():
                wave = self.codec.decode(
                    codes[: cfg.n_codebooks].unsqueeze(0).to(self.device),
                    self.s.decode_chunk_frames,
                    self.s.decode_context_frames,
                    on_chunk,
                )[0]
            audio = wave.float().t().cpu().numpy()  # (samples, channels)
            timings["decoder_sec"] = time.perf_counter() - t
        finally:
            if self.s.runtime_mode == "one_shot":
                superres = None  # this frame's reference would keep the model alive through the release
                self._unload_stage2()

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
                "superres_prompt": len(sr_prompt),
                "frames": int(codes.shape[1]),
                "stopped_by": bb.stopped_by,
            },
            "timings": timings,
            "duration_sec": duration_sec,
            "requested_sec": req.duration * 60,
            "sample_rate": cfg.sample_rate,
            "channels": int(audio.shape[1]),
            "device": str(self.device),
            "runtime_mode": self.s.runtime_mode,
            "load_sec": dict(self.load_sec),
        }
        ctx.report("decoding", 1, 1, "writing files")
        mp3 = Mp3Options(self.s.mp3_bitrate_mode, self.s.mp3_compression_level)
        timings["model_sec"] = time.perf_counter() - t_all
        wav, mp3_name, meta, metadata = write_track(self.s.output_dir, audio, cfg.sample_rate, metadata, mp3)
        log.info(
            "task %s: wrote %s (%.2fs audio) in %.2fs", req.task_id, wav, duration_sec, time.perf_counter() - t_all
        )
        return TrackResult(wav, mp3_name, meta, duration_sec, bb.new_tokens, req.seed, metadata)
