"""P5: backbone tokens/s at batch 1 vs Hugging Face transformers GPT-2 ``generate``.

Same width, depth, heads and vocabulary, random weights, CPU, one thread, top-k sampling,
KV cache on both. Baseline in the same run: HF GPT-2. Needs ``pip install -r bench/requirements.txt``.
"""

from __future__ import annotations

import time

import torch

from bench.common import args, report


def ours_tokens_per_s(layers: int, hidden: int, heads: int, vocab: int, new: int, compiled: bool = False) -> float:
    from songserve.pipeline.context import TaskContext
    from songserve.pipeline.engine.arch import GPTArch
    from songserve.pipeline.engine.decode_step import DecodeStep
    from songserve.pipeline.engine.gpt import AcousticGPT, build_model
    from songserve.pipeline.numbers import BACKBONE_LEVELS, CODEBOOK
    from songserve.pipeline.stages.backbone import Backbone

    text = vocab - BACKBONE_LEVELS * CODEBOOK
    arch = GPTArch("backbone", layers, hidden, heads, 4 * hidden, text, vocab, new + 64, 64)
    bb = Backbone(AcousticGPT(arch, build_model(arch, torch.device("cpu"), torch.float32)), eod_id=1)
    if compiled:  # one KV bucket covering the whole song: one compile, a masked tail
        bb.compiled, bb.bucket = DecodeStep(bb.dm, "compiled", new + 64), new + 64
    prompt = list(range(2, 34))
    bb.generate(
        prompt, new // 2, top_k=50, temperature=1.0, generator=torch.Generator().manual_seed(0), ctx=TaskContext()
    )
    t0 = time.perf_counter()
    r = bb.generate(
        prompt,
        new // 2,
        top_k=50,
        temperature=1.0,
        generator=torch.Generator().manual_seed(0),
        ctx=TaskContext(),
        min_share=1.0,
    )
    return r.new_tokens / (time.perf_counter() - t0)


def hf_tokens_per_s(layers: int, hidden: int, heads: int, vocab: int, new: int) -> float:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=vocab, n_positions=new + 64, n_embd=hidden, n_layer=layers, n_head=heads)
    model = GPT2LMHeadModel(cfg).eval()
    prompt = torch.arange(2, 34).view(1, -1)
    kw = dict(do_sample=True, top_k=50, use_cache=True, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        model.generate(prompt, max_new_tokens=16, min_new_tokens=16, **kw)
        t0 = time.perf_counter()
        out = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, **kw)
    return (out.shape[1] - prompt.shape[1]) / (time.perf_counter() - t0)


def main() -> None:
    from songserve.pipeline.checkpoints.megatron_env import init_megatron
    from songserve.pipeline.numbers import BACKBONE_LEVELS, CODEBOOK

    a = args(__doc__, new_tokens=1000)
    torch.set_num_threads(1)
    init_megatron(torch.device("cpu"), 0, seed=0)
    new = 16 if a.smoke else a.new_tokens
    parts = []
    for name, (layers, hidden, heads) in {"tiny 2x64": (2, 64, 4), "mid 8x512": (8, 512, 8)}.items():
        if a.smoke and name.startswith("mid"):
            continue
        vocab = 1024 + BACKBONE_LEVELS * CODEBOOK
        ours = ours_tokens_per_s(layers, hidden, heads, vocab, new)
        comp = ours_tokens_per_s(layers, hidden, heads, vocab, new, compiled=True) if not a.smoke else ours
        try:
            hf = hf_tokens_per_s(layers, hidden, heads, vocab, new)
        except ImportError:
            parts.append(f"{name}: eager {ours:.0f}, compiled {comp:.0f} tok/s (transformers not installed)")
            continue
        parts.append(
            f"{name}: eager {ours / hf:.2f}x, compiled {comp / hf:.2f}x ({ours:.0f}, {comp:.0f} vs {hf:.0f} tok/s)"
        )
    report("P5", f"backbone vs HF GPT-2 generate, batch 1, {new} tokens, 1 thread: " + "; ".join(parts))


if __name__ == "__main__":
    main()
