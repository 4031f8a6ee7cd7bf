"""LoRA adapters' device rows (started by bench/gpu_check.sh after its table): the decode step with
adapters in each mode that captures (eager, graphs, fused) on release shapes, bf16.

Per mode, ms per step at position 1,000 of a 1,024 bucket: the base step at batch 1; one row on an
adapter (rank 16, every target) vs the base step; 4 rows on 4 different adapters vs 4 rows on one.
And whether a mixed batch (two adapters and a row with none) draws the eager step's tokens over 32
steps. One line per mode (``GPU-adapters {json}``) into ``OUT/gpu_adapters.json``.

``--smoke``: tiny shapes on the CPU (fp32; Triton's interpreter for fused), 2 steps: seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

if shutil.which("nvidia-smi") is None:  # before anything imports triton (kernels.py says why)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from bench.common import args, report
from bench.gpu_song import Shape, release_gpt

RELEASE = Shape(24, 2048, 32, 8, 5632)
SMOKE = Shape(2, 64, 4, 2, 96)
RANK = 16


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _adapter(dm: Any, seed: int) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {
        (i, t): (torch.randn(RANK, n_in, generator=g) / n_in**0.5, torch.randn(n_out, RANK, generator=g) * 0.05)
        for i in range(len(dm.layers))
        for t, (n_in, n_out) in dm.lora_dims().items()
    }


def _ms(fn: Any, cache: Any, dev: torch.device, batch: int, kv: int, lora: Any, n: int) -> float:
    tok = torch.zeros(batch, dtype=torch.long, device=dev)
    pos = torch.tensor([kv - 24], device=dev)
    for _ in range(min(n, 3)):
        fn(tok, pos, cache.k, cache.v, kv, True, lora)
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(n):
        fn(tok, pos, cache.k, cache.v, kv, True, lora)
    _sync(dev)
    return (time.perf_counter() - t0) / n * 1000


def _tokens(fn: Any, cache: Any, dm: Any, dev: torch.device, kv: int, lora: Any, n: int) -> torch.Tensor:
    """Greedy tokens of 3 rows from one start over ``n`` steps (a mixed batch's)."""
    tok = torch.tensor([5, 6, 7], device=dev)
    out = []
    for i in range(n):
        h = fn(tok, torch.tensor([kv - 2 * n + i], device=dev), cache.k, cache.v, kv, True, lora)
        tok = (h.float() @ dm.output_weight[:1024].t().float()).argmax(-1)
        out.append(tok)
    return torch.stack(out).cpu()


def main() -> None:
    from songserve.pipeline.checkpoints.megatron_env import init_megatron
    from songserve.pipeline.engine.decode_step import DecodeStep
    from songserve.pipeline.engine.lora import row_lora
    from songserve.pipeline.stages.backbone import Backbone

    a = args(__doc__, out=os.environ.get("OUT", "/tmp/gpu-check"), steps=50)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.smoke:
        dev, shape, dtype, kv, steps = torch.device("cpu"), SMOKE, torch.float32, 64, 2
        torch.set_num_threads(1)
    elif torch.cuda.is_available():
        dev, shape, dtype, kv, steps = torch.device("cuda", 0), RELEASE, torch.bfloat16, 1024, a.steps
    else:
        report("GPU-adapters", "no CUDA device: nothing measured (--smoke runs the same code on the CPU)")
        sys.exit(1)
    init_megatron(dev, 0, seed=0)
    bb = Backbone(release_gpt(shape, "backbone", 25600, dev, dtype), eod_id=128001)
    dm = bb.dm
    slots = dm.lora_slots(4, 64)
    for s in range(1, 5):
        slots.install(s, f"a{s}", {k: (x.to(dev, dtype), y.to(dev, dtype)) for k, (x, y) in _adapter(dm, s).items()})
    one = row_lora([1], [2.0], dev, dtype, [RANK])
    same4 = row_lora([1] * 4, [2.0] * 4, dev, dtype, [RANK] * 4)
    mixed4 = row_lora([1, 2, 3, 4], [2.0] * 4, dev, dtype, [RANK] * 4)
    mixed3 = row_lora([1, 0, 3], [2.0, 0.0, 2.0], dev, dtype, [RANK, 0, RANK])
    dm.rope_tables(kv)
    rows: list[dict[str, Any]] = []
    eager_tokens = None
    with torch.inference_mode():
        for mode in ("eager", "graphs", "fused"):
            row: dict[str, Any] = {"mode": mode}
            try:
                step = DecodeStep(dm, mode, bb.gpt.arch.context_length)
                if step.failed:
                    raise RuntimeError(step.failed)

                def cache(b: int, step: DecodeStep = step) -> Any:
                    return step.cache_for(b, bb.gpt.arch.context_length) if step.persistent else dm.new_cache(b, kv)

                base = _ms(step, cache(1), dev, 1, kv, None, steps)
                row["base_b1_ms"] = round(base, 3)
                row["one_adapter_x"] = round(_ms(step, cache(1), dev, 1, kv, one, steps) / base, 3)
                same = _ms(step, cache(4), dev, 4, kv, same4, steps)
                row["b4_4_adapters_vs_1_x"] = round(_ms(step, cache(4), dev, 4, kv, mixed4, steps) / same, 3)
                got = _tokens(step, cache(3), dm, dev, kv, mixed3, 2 if a.smoke else 32)
                eager_tokens = got if eager_tokens is None else eager_tokens
                row["mixed_tokens_eq_eager"] = bool(torch.equal(got, eager_tokens))
                row["fallback"] = step.failed
            except Exception as exc:  # one mode's failure leaves the others' rows
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows.append(row)
            report("GPU-adapters", json.dumps(row))
            (out / "gpu_adapters.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
