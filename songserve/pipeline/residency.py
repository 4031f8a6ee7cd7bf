"""Where each stage's weights are: loading, releasing and parking them (``RUNTIME_MODE``, ``PARK_BACKBONE``).

Tokenizer and backbone stay resident. In ``one_shot`` mode super-resolution and decoder are loaded
for each request and released afterwards; in ``keep_loaded`` mode they stay; in ``park`` mode they
wait in (pinned, on CUDA) host memory and move to the device only for their stage. The codec's
encoder (an upload's audio into codes) lives as the decoder does: loaded for each encoding and
released (one_shot), resident (keep_loaded), or parked and moved in for it (park). A set whose
decoder file has no encoder still serves songs: ``encoder_error`` says why it cannot encode.

Park mode as a state machine over ``parked`` (the stages whose weights are in host memory now):
idle and during the backbone ``{superres, decoder}``; during superres ``{decoder}``, during the
decoder ``{superres}``, each plus ``backbone`` when ``PARK_BACKBONE`` parks it for those two
stages (``1``; ``auto``: when the device's free memory is short of what they need). A batch walks
the transitions below in order: ``load_stage2``, ``enter_superres``, ``leave_superres``,
``enter_decoder``, ``end_batch`` (a batch whose live audio is wanted loads and unparks stage 2
during the backbone: ``enter_preview``); however it ends (done, cancelled, failed mid-stage),
``end_batch`` returns the state to idle's. Every move swaps the ``.data`` of the same parameter
objects (models, decode functions and tests keep their references) and the host copy is kept, so
parking is free and unparking is one host→device copy; on the CPU both are no-ops and the outputs
are keep_loaded's. The backbone's captured CUDA graphs read the old addresses: they are dropped at
a park and captured again on first use.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from songserve.errors import ConfigError, UnavailableError
from songserve.pipeline.checkpoints.gpt_load import load_model
from songserve.pipeline.checkpoints.layout import CheckpointSet
from songserve.pipeline.config import PipelineConfig
from songserve.pipeline.engine.arch import GPTArch
from songserve.pipeline.engine.gpt import AcousticGPT
from songserve.pipeline.numbers import CODEBOOK
from songserve.pipeline.stages import tokenizer as tk
from songserve.pipeline.stages.backbone import Backbone
from songserve.pipeline.stages.codec import AudioDecoder, DecoderConfig, load_decoder
from songserve.pipeline.stages.encoder import AudioEncoder, load_encoder
from songserve.pipeline.stages.superres import SuperRes

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


class Residency:
    """One pipeline's loaded models and where their weights are now (see the module docstring)."""

    def __init__(
        self, settings: PipelineConfig, ckpt: CheckpointSet, device: torch.device, phase: Callable[[str], None]
    ) -> None:
        self.s = settings
        self.ckpt = ckpt
        self.device = device
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.phase = phase  # loading phases, shown in /health
        self.tokenizer: tk.TextTokenizer | None = None
        self.backbones: dict[str, Backbone] = {}
        self.superres: dict[str, SuperRes] = {}
        self.decoder: AudioDecoder | None = None
        self.encoder: AudioEncoder | None = None
        self.encoder_error: str | None = None  # why this set cannot encode (checked at load)
        self.decoder_cfg = DecoderConfig()
        self.load_sec: dict[str, float] = {}
        self.superres_arch: dict[str, GPTArch] = {}
        self.parked: set[str] = set()  # park mode: stages whose weights wait in host memory now
        self._host: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # park: tensor → its host copy

    # -- lifecycle ------------------------------------------------------------------------------
    def load(self) -> None:
        """Load what stays resident; validate everything else once, so start-up fails early."""
        if self.s.park_backbone == "1" and self.s.runtime_mode != "park":
            raise ConfigError(
                f"PARK_BACKBONE=1 parks the backbone in park mode only; RUNTIME_MODE is {self.s.runtime_mode}."
            )
        self.phase("loading_backbone")
        self.tokenizer = tk.load_tokenizer(self.ckpt.tokenizer)
        eod = self.tokenizer.token_id(tk.EOD)
        t0 = time.perf_counter()
        for name, path in self.ckpt.backbones.items():
            self.backbones[name] = Backbone(self._gpt(path, "backbone", name), eod, prefill_chunk=self.s.prefill_chunk)
        self.load_sec["backbone"] = round(time.perf_counter() - t0, 3)
        self.load_stage2()
        assert self.decoder is not None
        self.decoder_cfg = self.decoder.cfg  # rates and frame size, kept when one_shot unloads the decoder
        self.superres_arch = {n: sr.gpt.arch for n, sr in self.superres.items()}
        self._check_encoder()
        if self.s.runtime_mode == "one_shot":
            self._unload_stage2()
        if self.s.runtime_mode == "park":
            self._park("superres")
            self._park("decoder")
            self._park("encoder")
            if self.s.park_backbone != "0":
                self._host_copy("backbone")  # now, at load: parking it later costs nothing

    def status(self) -> dict[str, Any]:
        """What is loaded and, in park mode, parked: for /health."""
        out: dict[str, Any] = {
            "backbone_loaded": bool(self.backbones),
            "superres_loaded": bool(self.superres),
            "decoder_loaded": self.decoder is not None,
            "encoder_loaded": self.encoder is not None,
            "load_sec": dict(self.load_sec),  # the latest load of each stage
        }
        if self.s.runtime_mode == "park":
            out["parked"] = sorted(self.parked)
            out["park_backbone"] = self.s.park_backbone
        return out

    # -- one batch's transitions ------------------------------------------------------------------
    def load_stage2(self) -> None:
        """Super-resolution and decoder loaded (one_shot: for this batch; otherwise they already are)."""
        if not self.superres:
            self.phase("loading_superres")
            t0 = time.perf_counter()
            self.superres = {n: SuperRes(self._gpt(p, "superres", n)) for n, p in self.ckpt.superres.items()}
            self.load_sec["superres"] = round(time.perf_counter() - t0, 3)
        if self.decoder is None:
            self.phase("loading_decoder")
            t0 = time.perf_counter()
            self.decoder = load_decoder(
                self.ckpt.decoder_config,
                self.ckpt.decoder_checkpoint,
                self.device,
                trust_pickle=self.s.trust_checkpoint_pickle,
            )
            self.load_sec["decoder"] = round(time.perf_counter() - t0, 3)

    # -- one encoding ----------------------------------------------------------------------------
    def _check_encoder(self) -> None:
        """Load the encoder once at start-up; a set without one serves songs and says why it cannot encode."""
        try:
            self._load_encoder()
        except ConfigError as exc:
            self.encoder_error = str(exc)
            log.warning("no audio encoder: uploads cannot be encoded here (%s)", exc)

    def _load_encoder(self) -> None:
        if self.encoder is None:
            self.phase("loading_encoder")
            t0 = time.perf_counter()
            self.encoder = load_encoder(
                self.ckpt.decoder_config,
                self.ckpt.decoder_checkpoint,
                self.device,
                trust_pickle=self.s.trust_checkpoint_pickle,
            )
            self.load_sec["encoder"] = round(time.perf_counter() - t0, 3)

    def enter_encoder(self) -> AudioEncoder:
        """The encoder on the device (one_shot: loaded now)."""
        if self.encoder_error is not None:
            raise UnavailableError(f"This worker cannot encode audio: {self.encoder_error}")
        self._load_encoder()
        self._unpark("encoder")
        assert self.encoder is not None
        return self.encoder

    def end_encode(self) -> None:
        """After an encoding, however it ended: parked again, or released (one_shot; the caller drops its reference first)."""
        self._park("encoder")
        if self.s.runtime_mode == "one_shot":
            self.encoder = None
            release_memory(self.device)

    def enter_superres(self, superres: SuperRes, takes: int, seq: int) -> None:
        """Before super-resolution: its weights on the device, the backbone's parked if it must be."""
        if self.backbone_must_park(superres, takes, seq):
            self._park("backbone")
        self._unpark("superres")

    def enter_preview(self) -> None:
        """Live audio wanted during the backbone (``preview.py``): super-resolution and decoder on the
        device beside it (park mode unparks them early; they stay until ``end_batch``)."""
        self._unpark("superres")
        self._unpark("decoder")

    def leave_superres(self) -> None:
        self._park("superres")

    def enter_decoder(self) -> None:
        self._unpark("decoder")

    def end_batch(self) -> None:
        """Back to idle's state however the batch ended; one_shot releases super-resolution and decoder
        (the caller drops its own references to them first)."""
        self._park("superres")
        self._park("decoder")
        self._unpark("backbone")
        if self.s.runtime_mode == "one_shot":
            self._unload_stage2()

    def backbone_must_park(self, superres: SuperRes, takes: int, seq: int) -> bool:
        """PARK_BACKBONE for this batch: ``1`` always, ``0`` never, ``auto`` when the device's free
        memory (free plus what torch's cache holds unused) is short of ``stage2_need`` (the CPU: never)."""
        if self.s.runtime_mode != "park" or self.s.park_backbone == "0":
            return False
        if self.s.park_backbone == "1":
            return True
        if self.device.type != "cuda":
            return False
        free = torch.cuda.mem_get_info(self.device)[0]
        free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        need = self.stage2_need(superres, takes, seq)
        if free < need:
            log.info(
                "parking the backbone: %.0f MiB free, superres and decoder need ~%.0f MiB", free / 2**20, need / 2**20
            )
        return free < need

    def stage2_need(self, superres: SuperRes, takes: int, seq: int) -> int:
        """Device bytes superres and decoder take once unparked: their weights, plus an estimate of a
        superres pass's live tensors (one layer's: x, qkv, attention out, projections ≈ 8·hidden, MLP
        ≈ 3·ffn per position, and fp32 logits over one codebook)."""
        weights = sum(h.numel() * h.element_size() for st in ("superres", "decoder") for _, h in self._host.get(st, []))
        a = superres.gpt.arch
        elt = int(superres.dm.word.element_size())
        per_position = (8 * a.hidden_size + 3 * a.ffn_hidden_size) * elt + CODEBOOK * 4
        return weights + takes * seq * per_position

    # -- park mode: stage weights wait in host memory ---------------------------------------------
    def _modules(self, stage: str) -> list[torch.nn.Module]:
        if stage == "backbone":
            return [bb.gpt.model for bb in self.backbones.values()]
        if stage == "superres":
            return [sr.gpt.model for sr in self.superres.values()]
        if stage == "encoder":
            return [self.encoder] if self.encoder is not None else []
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
                if bb.compiled is not None:
                    bb.compiled.reset()  # its graphs and persistent cache hold the old addresses

    # -- loading and releasing --------------------------------------------------------------------
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

    def _unload_stage2(self) -> None:
        """Drop every reference this object holds, then return the memory (callers drop theirs first)."""
        self.superres.clear()
        self.superres, self.decoder, self.encoder = {}, None, None
        release_memory(self.device)


def mem_available() -> int:
    """Bytes of host memory available (``MemAvailable``), 0 where ``/proc`` does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
