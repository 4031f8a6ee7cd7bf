"""P4: backbone per-token time at position 4,000 vs 250 (the KV cache keeps it nearly flat).

Baseline in the same run: position 250. Tiny config (2×64) and a mid-size config (8×512).
``--smoke``: the tiny config only, positions 32 vs 8, 2 steps.
"""

from __future__ import annotations

import time

import torch

from bench.common import args, median, report


def per_token_ms(gpt, position: int, steps: int) -> float:
    from songserve.pipeline.engine.oracle import causal_mask, megatron_forward, new_kv_context
    from songserve.pipeline.numbers import CODEBOOK

    dev = gpt.device
    with torch.inference_mode():
        cache = new_kv_context(gpt, position + steps + 1)
        ids = torch.randint(0, gpt.arch.vocab_size, (1, position, 1))
        megatron_forward(gpt, ids, torch.arange(position).view(1, -1), causal_mask(position, dev), cache)
        cache.increment_sequence_len_offset(position)
        times = []
        for i in range(steps):
            step = torch.randint(0, gpt.arch.vocab_size, (1, 1, 1))
            t0 = time.perf_counter()
            h = megatron_forward(gpt, step, torch.tensor([[position + i]]), None, cache)[-1]
            gpt.project(h, gpt.arch.text_vocab_size, gpt.arch.text_vocab_size + CODEBOOK)
            times.append(time.perf_counter() - t0)
            cache.increment_sequence_len_offset(1)
    return median(times) * 1000


def main() -> None:
    from songserve.pipeline.checkpoints.megatron_env import init_megatron
    from songserve.pipeline.engine.arch import GPTArch
    from songserve.pipeline.engine.gpt import AcousticGPT, build_model
    from songserve.pipeline.numbers import BACKBONE_LEVELS, CODEBOOK

    a = args(__doc__, steps=60)
    torch.set_num_threads(1)
    init_megatron(torch.device("cpu"), 0, seed=0)
    configs = {"tiny 2x64": (2, 64, 4), "mid 8x512": (8, 512, 8)}
    if a.smoke:
        del configs["mid 8x512"]
    near, far = (8, 32) if a.smoke else (250, 4000)
    parts = []
    for name, (layers, hidden, heads) in configs.items():
        arch = GPTArch(
            "backbone",
            layers,
            hidden,
            heads,
            4 * hidden,
            1024,
            1024 + BACKBONE_LEVELS * CODEBOOK,
            far + a.steps + 8,
            1024,
        )
        gpt = AcousticGPT(arch, build_model(arch, torch.device("cpu"), torch.float32))
        steps = 2 if a.smoke else a.steps
        base = per_token_ms(gpt, near, steps)
        deep = per_token_ms(gpt, far, steps)
        parts.append(f"{name}: {deep / base:.2f}x ({deep:.2f} vs {base:.2f} ms/token)")
    report("P4", f"per-token time at position {far} vs {near}: " + "; ".join(parts))


if __name__ == "__main__":
    main()
