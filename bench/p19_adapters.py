"""P19: the decode step with LoRA adapters: one row on an adapter vs the base step, and 4 rows on 4
different adapters vs 4 rows on one.

Baselines in the same run: the base step (batch 1) and the batch of 4 on one adapter. Eager step,
1 thread, CPU time (best of interleaved rounds); adapters of rank 16 on every target in
``MAX_ADAPTERS`` = 4 slots (slot rank 64). Tiny config (2×64) and a mid-size config (8×512), KV at
position 256.
``--smoke``: the tiny config only, 2 steps, one round.
"""

from __future__ import annotations

import time

import torch

from bench.common import args, report


def _adapter(dm, rank: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        (i, t): (torch.randn(rank, n_in, generator=g) / n_in**0.5, torch.randn(n_out, rank, generator=g) * 0.1)
        for i in range(len(dm.layers))
        for t, (n_in, n_out) in dm.lora_dims().items()
    }


def step_ms(dm, batch: int, lora, position: int, steps: int) -> float:
    cache = dm.new_cache(batch, position + steps + 1)
    tokens = torch.randint(0, 1024, (batch,))
    picked = dm.pick_lora(lora)  # as the eager loop does: once a batch
    t0 = time.process_time()  # CPU time: other sessions' load preempts us, it does not bill us
    for i in range(steps):
        dm.step(tokens, torch.tensor([position + i]), cache.k, cache.v, position + i + 1, False, lora, picked)
    return (time.process_time() - t0) / steps * 1000


def main() -> None:
    from songserve.pipeline.checkpoints.megatron_env import init_megatron
    from songserve.pipeline.engine.arch import GPTArch
    from songserve.pipeline.engine.gpt import AcousticGPT, build_model
    from songserve.pipeline.engine.lora import row_lora
    from songserve.pipeline.engine.transformer import DecodeModel
    from songserve.pipeline.numbers import BACKBONE_LEVELS, CODEBOOK

    a = args(__doc__, steps=40, rounds=5, rank=16)
    torch.set_num_threads(1)
    init_megatron(torch.device("cpu"), 0, seed=0)
    configs = {"tiny 2x64": (2, 64, 4), "mid 8x512": (8, 512, 8)}
    if a.smoke:
        del configs["mid 8x512"]
    steps, rounds, position = (2, 1, 8) if a.smoke else (a.steps, a.rounds, 256)
    parts = []
    for name, (layers, hidden, heads) in configs.items():
        arch = GPTArch(
            "backbone", layers, hidden, heads, 4 * hidden, 1024, 1024 + BACKBONE_LEVELS * CODEBOOK, 2048, 1024
        )
        gpt = AcousticGPT(arch, build_model(arch, torch.device("cpu"), torch.float32))
        dm = DecodeModel(gpt.model, gpt.output_weight)
        slots = dm.lora_slots(4, 64)
        for s in range(1, 5):
            slots.install(s, f"a{s}", _adapter(dm, a.rank, s))
        one = row_lora([1], [2.0], dm.device, dm.dtype, [a.rank])
        same4 = row_lora([1, 1, 1, 1], [2.0] * 4, dm.device, dm.dtype, [a.rank] * 4)
        mixed4 = row_lora([1, 2, 3, 4], [2.0] * 4, dm.device, dm.dtype, [a.rank] * 4)
        dm.rope_tables(position + steps + 2)
        got: dict[str, list[float]] = {k: [] for k in ("base", "one", "same4", "mixed4")}
        with torch.inference_mode():
            for _ in range(rounds):
                got["base"].append(step_ms(dm, 1, None, position, steps))
                got["one"].append(step_ms(dm, 1, one, position, steps))
                got["same4"].append(step_ms(dm, 4, same4, position, steps))
                got["mixed4"].append(step_ms(dm, 4, mixed4, position, steps))
        m = {k: min(v) for k, v in got.items()}
        parts.append(
            f"{name}: one adapter {m['one'] / m['base']:.2f}x the base step ({m['one']:.2f} vs {m['base']:.2f} ms); "
            f"4 rows on 4 adapters {m['mixed4'] / m['same4']:.2f}x 4 on one ({m['mixed4']:.2f} vs {m['same4']:.2f} ms)"
        )
    report("P19", f"decode step with LoRA adapters (rank {a.rank}, eager, 1 thread): " + "; ".join(parts))


if __name__ == "__main__":
    main()
