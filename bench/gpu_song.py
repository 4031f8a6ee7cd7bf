"""bench/gpu_check.py's models and its song: the release-shaped GPTs with random weights, and one
song per stage (backbone, super-resolution, decoder) with its seconds, real-time factor and peak memory.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

T_TEXT = 128256
PROMPT = list(range(2, 202))
_built: dict[str, Any] = {}  # the super-resolution model and the decoder, built once for both songs


@dataclasses.dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    groups: int
    ffn: int


def release_gpt(shape: Shape, kind: str, context: int, device: torch.device, dtype: torch.dtype) -> Any:
    """The model the worker builds (``build_model``, the release's architecture family of
    ``tiny.release_arch``, its padded vocabulary rows included) at ``shape``, with random weights
    drawn on the device: megatron's own initialisation runs on the CPU, which at the release's size
    would spend the scarce device time waiting."""
    from songserve.pipeline.engine.gpt import AcousticGPT, build_model
    from songserve.pipeline.tiny.build import release_arch

    arch = dataclasses.replace(
        release_arch(kind, T_TEXT),
        num_layers=shape.layers,
        hidden_size=shape.hidden,
        num_attention_heads=shape.heads,
        num_query_groups=shape.groups,
        ffn_hidden_size=shape.ffn,
        max_sequence_length=context,
        max_prompt_length=4096,
    )
    model = build_model(arch, device, dtype, init=False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
            else:  # norm weights 1, biases 0
                p.fill_(0.0 if name.endswith("bias") else 1.0)
    return AcousticGPT(arch, model)


def _timed(dev: torch.device, fn: Any) -> tuple[Any, float, float]:
    """(result, seconds, peak GiB) of one stage."""
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = fn()
    peak = 0.0
    if dev.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**30
    return out, time.perf_counter() - t0, peak


def song(
    bb: Any, shape: Shape, dev: torch.device, dtype: torch.dtype, seconds: float, takes: int, mode: str, smoke: bool
) -> dict[str, Any]:
    """``takes`` takes of a ``seconds`` song through the three stages, the backbone in ``mode``."""
    from songserve.pipeline.context import TaskContext
    from songserve.pipeline.engine.decode_step import DecodeStep
    from songserve.pipeline.numbers import HOP, SAMPLE_RATE
    from songserve.pipeline.stages.backbone import Take
    from songserve.pipeline.stages.codec import AudioDecoder, DecoderConfig
    from songserve.pipeline.stages.length import LengthPlan
    from songserve.pipeline.stages.superres import SuperRes

    frames = max(1, int(seconds * SAMPLE_RATE / HOP))
    # compiled: one bucket for the whole song (one inductor compile); captured modes: 1,024-key buckets
    bb.bucket = 1 << (len(PROMPT) + 2 * frames).bit_length() if mode == "compiled" else 1024
    bb.compiled = None
    if mode != "eager":
        bb.compiled = DecodeStep(bb.dm, mode, bb.gpt.arch.context_length, backend="aot_eager" if smoke else "inductor")
    gens = [torch.Generator(device=dev).manual_seed(i) for i in range(takes)]
    ctxs = [TaskContext(f"song{i}") for i in range(takes)]
    row: dict[str, Any] = {"seconds": seconds, "takes": takes, "mode": mode}
    with torch.inference_mode():
        plan = LengthPlan(frames, frames, 2 * frames)
        if bb.compiled is not None:  # compiled or captured before the clock starts, as the worker does at load
            bb.compiled.warm([takes], [bb.bucket], bb.gpt.arch.context_length)
        res, t_bb, p_bb = _timed(
            dev,
            lambda: bb.generate_batch(
                PROMPT, plan, [Take(g, c) for g, c in zip(gens, ctxs, strict=True)], top_k=80, temperature=1.0
            ),
        )
        coarse = [r.codes for r in res]
        if "superres" not in _built:
            _built["superres"] = SuperRes(release_gpt(shape, "superres", 8192 + 2048, dev, dtype))
            _built["decoder"] = AudioDecoder(DecoderConfig(n_filters=8) if smoke else DecoderConfig()).to(dev).eval()
        sr, decoder = _built["superres"], _built["decoder"]
        codes, t_sr, p_sr = _timed(dev, lambda: sr.generate_batch(PROMPT, coarse, top_k=10, generators=gens, ctxs=ctxs))
        batch = torch.stack([c.to(dev) for c in codes])
        _, t_dec, p_dec = _timed(dev, lambda: decoder.decode(batch, 256, 16))
    bb.compiled = None
    total = t_bb + t_sr + t_dec
    row.update(
        backbone=round(t_bb, 2),
        superres=round(t_sr, 2),
        decoder=round(t_dec, 2),
        total=round(total, 2),
        rtf=round(seconds / total, 1),
        peak_gib=round(max(p_bb, p_sr, p_dec), 1),
    )
    return row
