"""P20: what an idle CPU worker's process group costs: megatron's groups on one shared gloo device against stock gloo.

A CPU worker starts a world of one and megatron's parallel state (``init_megatron``); stock gloo gives
each of megatron's twenty-odd groups a device whose event loop wakes every 10 ms, and two worker
threads. Each round runs two fresh interpreters one after the other: the baseline with stock gloo and
megatron's defaults (``init_process_group("gloo")``, ``initialize_model_parallel(1, 1)``), and the worker's
own ``init_megatron`` (one device and one thread shared by every group). Each then sits idle for
``--seconds`` and reports the CPU time its process spent meanwhile (user + sys: the VM is shared, and
wall time would count waits for a core) and its threads. The figure is the worker's idle CPU over the
baseline's, medians of ``--rounds`` interleaved rounds. ``--smoke``: 1 s idle, one round.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.common import args, median, report

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, sys, time
import torch
kind, seconds = sys.argv[1], float(sys.argv[2])
if kind == "stock":
    import torch.distributed as dist
    from megatron.core import parallel_state
    from torch._C._distributed_c10d import HashStore
    dist.init_process_group(backend="gloo", store=HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
else:
    from songserve.pipeline.checkpoints.megatron_env import init_megatron
    init_megatron(torch.device("cpu"), 0, seed=0)
time.sleep(0.5)  # the groups' threads settle
before = os.times()
time.sleep(seconds)
after = os.times()
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
print(json.dumps({
    "cpu_s": (after.user + after.system) - (before.user + before.system),
    "threads": len(names),
    "loops": names.count("gloo_tcp_loop"),
}))
"""


def idle(kind: str, seconds: float) -> dict[str, float]:
    """One fresh interpreter's idle CPU time, threads and gloo event loops after ``kind``'s start."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, kind, str(seconds)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120 + seconds,
        env=env,
        check=True,
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    a = args(__doc__.splitlines()[0], seconds=30.0, rounds=3)
    seconds, rounds = (1.0, 1) if a.smoke else (a.seconds, a.rounds)
    runs: dict[str, list[dict[str, float]]] = {"stock": [], "shared": []}
    for _ in range(rounds):
        for kind in runs:  # interleaved: drift hits each alike
            runs[kind].append(idle(kind, seconds))
    cpu = {k: median([r["cpu_s"] for r in rs]) for k, rs in runs.items()}
    per_min = {k: 1000 * v * 60 / seconds for k, v in cpu.items()}
    ratio = cpu["shared"] / cpu["stock"] if cpu["stock"] > 0 else float("nan")
    stock, shared = runs["stock"][-1], runs["shared"][-1]
    report(
        "P20",
        f"idle CPU of a worker's process group, shared gloo device vs stock: {ratio:.2f}x "
        f"({per_min['shared']:.0f} vs {per_min['stock']:.0f} CPU-ms per idle minute); threads "
        f"{shared['threads']:.0f} vs {stock['threads']:.0f}, gloo event loops {shared['loops']:.0f} vs "
        f"{stock['loops']:.0f}; {rounds} rounds of {seconds:g} s idle",
    )


if __name__ == "__main__":
    main()
