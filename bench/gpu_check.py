"""Device checks for one GPU (run by bench/gpu_check.sh): decode tokens/s eager vs CUDA graphs at
batch 1 and 2, and one 30 s track at the release's full-size shapes with random weights.

Release shapes (shared/docs/model.md): 24 layers, hidden 2,048, 32 heads in 8 query groups, SwiGLU
ffn 5,632, RMSNorm ε 1e-6, RoPE base 500,000, qkv biases, untied output, bf16; backbone vocabulary
130,304 in 130,432 rows (context 25,600), superres 193,792 in 193,920 rows; the full DAC decoder.
One summary line per figure.

``--smoke`` runs the same code at small shapes on whatever device there is (the CPU in CI), so the
script cannot rot between the rare runs on a GPU; CUDA graphs are then skipped.
"""

from __future__ import annotations

import dataclasses
import sys
import time
import traceback
from pathlib import Path

import torch

from bench.common import args, report

T_TEXT = 128256


@dataclasses.dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    groups: int
    ffn: int


RELEASE = Shape(24, 2048, 32, 8, 5632)
SMOKE = Shape(2, 128, 4, 2, 256)


def release_gpt(shape: Shape, kind: str, context: int, device: torch.device):
    """The model the worker builds (``build_model``, the release's architecture family of
    ``tiny.release_arch``, its padded vocabulary rows included) at ``shape``, in bf16, with random
    weights drawn on the device: megatron's own initialisation runs on the CPU, which at the
    release's size would spend the scarce device time waiting."""
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
    model = build_model(arch, device, torch.bfloat16, init=False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
            else:  # norm weights 1, biases 0
                p.fill_(0.0 if name.endswith("bias") else 1.0)
    return AcousticGPT(arch, model)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def tokens_per_s(bb, dev: torch.device, batch: int, tokens: int) -> float:
    from songserve.pipeline.context import TaskContext
    from songserve.pipeline.stages.backbone import Take
    from songserve.pipeline.stages.length import LengthPlan

    def takes() -> list[Take]:
        return [Take(torch.Generator(device=dev).manual_seed(i), TaskContext(f"t{i}")) for i in range(batch)]

    plan = LengthPlan(tokens // 2, tokens // 2, tokens)
    with torch.inference_mode():
        bb.generate_batch(list(range(2, 258)), plan, takes(), top_k=80, temperature=1.0)  # warm-up
        sync(dev)
        t0 = time.perf_counter()
        bb.generate_batch(list(range(2, 258)), plan, takes(), top_k=80, temperature=1.0)
        sync(dev)
    return tokens / (time.perf_counter() - t0)


def decode_speed(bb, dev: torch.device, tokens: int) -> None:
    from songserve.pipeline.engine.decode_step import DecodeStep

    sizes = (1, 2, 4)
    eager = {b: tokens_per_s(bb, dev, b, tokens) for b in sizes}
    line = (
        f"eager b1 {eager[1]:.0f}, b2 {eager[2]:.0f}, b4 {eager[4]:.0f} tok/s/batch; "
        f"eager 2 takes cost {eager[1] / eager[2]:.2f}x one"
    )
    if dev.type == "cuda":
        t0 = time.perf_counter()
        step = DecodeStep(bb.dm, "graphs", bb.gpt.arch.max_sequence_length)
        step.warm(list(sizes), [1024])
        bb.compiled = step
        warm = time.perf_counter() - t0
        graphs = {b: tokens_per_s(bb, dev, b, tokens) for b in sizes}
        line += (
            f"; graphs b1 {graphs[1]:.0f}, b2 {graphs[2]:.0f}, b4 {graphs[4]:.0f}; "
            f"graphs/eager b1 {graphs[1] / eager[1]:.2f}x; 2 takes cost {graphs[1] / graphs[2]:.2f}x one take "
            f"(target <= 1.2x), 4 takes {graphs[1] / graphs[4]:.2f}x; capture {warm:.1f}s; "
            f"fallback {step.describe()['fallback']}"
        )
    else:
        line += "; graphs skipped (no CUDA)"
    report("GPU-decode", f"{tokens} tokens/take: {line}")


def track(bb, shape: Shape, dev: torch.device, seconds: float) -> None:
    from songserve.pipeline.context import TaskContext
    from songserve.pipeline.numbers import HOP, SAMPLE_RATE
    from songserve.pipeline.stages.backbone import Take
    from songserve.pipeline.stages.codec import AudioDecoder, DecoderConfig
    from songserve.pipeline.stages.length import LengthPlan
    from songserve.pipeline.stages.superres import SuperRes

    frames = max(1, int(seconds * SAMPLE_RATE / HOP))
    prompt = list(range(2, 202))
    ctx = TaskContext("track")
    gen = torch.Generator(device=dev).manual_seed(0)
    with torch.inference_mode():
        sync(dev)
        t0 = time.perf_counter()
        r = bb.generate_batch(
            prompt, LengthPlan(frames, frames, 2 * frames), [Take(gen, ctx)], top_k=80, temperature=1.0
        )
        sync(dev)
        t_bb = time.perf_counter() - t0
        coarse = r[0].codes
        sr = SuperRes(release_gpt(shape, "superres", 8192 + 2048, dev))
        sync(dev)
        t0 = time.perf_counter()
        codes = sr.generate(prompt, coarse, top_k=10, generator=gen, ctx=ctx)
        sync(dev)
        t_sr = time.perf_counter() - t0
        decoder = AudioDecoder(DecoderConfig()).to(dev).eval()
        t0 = time.perf_counter()
        wave = decoder.decode(codes.unsqueeze(0).to(dev), 256, 16)
        sync(dev)
        t_dec = time.perf_counter() - t0
    total = t_bb + t_sr + t_dec
    live = live_track(bb, sr, decoder, dev, frames, prompt, t_bb)
    peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0.0
    report(
        "GPU-track",
        f"{seconds:g}s track (random weights): backbone {t_bb:.1f}s ({coarse.numel() / t_bb:.0f} tok/s), "
        f"superres {t_sr:.1f}s, decoder {t_dec:.1f}s, total {total:.1f}s = {seconds / total:.1f}x real time; "
        f"audio {tuple(wave.shape)}, peak {peak:.1f} GiB; {live}",
    )


def live_track(bb, sr, decoder, dev: torch.device, frames: int, prompt: list[int], t_bb: float) -> str:
    """The same backbone run with a listener (issue 23): its preview thread beside the steps (its own
    CUDA stream). Time to the first live audio from the start, and the backbone's time over without."""
    import tempfile
    import threading

    from songserve.pipeline.context import TaskContext
    from songserve.pipeline.numbers import FRAMES_PER_SECOND
    from songserve.pipeline.preview import Previewer, PreviewStages
    from songserve.pipeline.stages.backbone import Take
    from songserve.pipeline.stages.length import LengthPlan

    ctx = TaskContext("live")
    ctx.live.want()
    first: list[float] = []
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        preview = Previewer([ctx], [0], frames, lambda: PreviewStages(sr, prompt, decoder), out_dir=Path(tmp),
                            device=dev, chunk_frames=round(2 * FRAMES_PER_SECOND), context_frames=16,
                            decode_context=16, top_k=10)  # fmt: skip
        gen = torch.Generator(device=dev).manual_seed(0)
        sync(dev)
        t0 = time.perf_counter()

        def watch() -> None:
            while not first:
                if ctx.live.frames_written:
                    first.append(time.perf_counter() - t0)
                elif ctx.live.state.final:
                    return
                time.sleep(0.005)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        bb.generate_batch(prompt, LengthPlan(frames, frames, 2 * frames), [Take(gen, ctx)], top_k=80,
                          temperature=1.0, listener=preview)  # fmt: skip
        sync(dev)
        t_live = time.perf_counter() - t0
        preview.close()
        watcher.join(10)
    got = f"{first[0]:.2f}s" if first else "none"
    return (f"live: first audio {got} after the start (target <= 1.5 s), backbone with a listener "
            f"{t_live / t_bb:.2f}x without (target <= 1.1x), {ctx.live.seconds:.1f}s of live audio")  # fmt: skip


def main() -> None:
    from songserve.pipeline.checkpoints.megatron_env import init_megatron
    from songserve.pipeline.stages.backbone import Backbone

    a = args(__doc__, tokens=512, seconds=30.0)
    if a.smoke:
        dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        shape, tokens, seconds = SMOKE, 16, 1.0
        torch.set_num_threads(1)
    elif torch.cuda.is_available():
        dev, shape, tokens, seconds = torch.device("cuda", 0), RELEASE, a.tokens, a.seconds
    else:
        report("GPU", "no CUDA device: nothing measured")
        sys.exit(0)
    init_megatron(dev, 0, seed=0)
    torch.backends.cuda.matmul.allow_tf32 = True

    t0 = time.perf_counter()
    bb = Backbone(release_gpt(shape, "backbone", 25600, dev), eod_id=128001)
    mem = torch.cuda.memory_allocated() / 2**30 if dev.type == "cuda" else 0.0
    report(
        "GPU-build",
        f"{shape.layers}x{shape.hidden} bf16 backbone on {dev.type} built in {time.perf_counter() - t0:.0f}s, {mem:.1f} GiB",
    )
    bb.bucket = 1024
    failed = False
    for name, run in (
        ("GPU-decode", lambda: decode_speed(bb, dev, tokens)),
        ("GPU-track", lambda: track(bb, shape, dev, seconds)),
    ):
        try:  # one figure failing still leaves the other: device time is scarce
            run()
        except Exception as exc:
            failed = True
            traceback.print_exc()
            report(name, f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
