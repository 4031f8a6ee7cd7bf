"""A CPU worker's process group: megatron's twenty-odd groups share one gloo device and one thread
(``pipeline/checkpoints/process_group.py``), and their collectives still compute what gloo's do.

Run in a fresh interpreter: the world is once per process, and what counts is what a worker's start
leaves running (stock gloo left 21 event loops, each waking every 10 ms, in 66 threads)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support.servers import ROOT

PROBE = r"""
import json, os
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from songserve.pipeline.checkpoints.megatron_env import init_megatron

init_megatron(torch.device("cpu"), 0, seed=0)
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
x = torch.arange(4.0)
dist.all_reduce(x, group=ps.get_tensor_model_parallel_group())
gathered = [None]
dist.all_gather_object(gathered, {"rank": dist.get_rank()}, group=ps.get_data_parallel_group())
dist.barrier()
print(json.dumps({
    "backend": dist.get_backend(),
    "gloo_loops": names.count("gloo_tcp_loop"),
    "threads": len(names),
    "all_reduce": x.tolist(),
    "gathered": gathered,
    "tp": ps.get_tensor_model_parallel_world_size(),
    "dp": ps.get_data_parallel_world_size(),
}))
"""


def test_megatrons_groups_share_one_gloo_device_and_compute_as_gloo_does() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # torch's own pool would count as many threads as cores
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["backend"] == "gloo_shared"
    assert seen["gloo_loops"] == 1  # stock gloo: one per group, 21
    assert seen["threads"] < 40  # stock gloo: 66 (two worker threads a group besides its loop)
    assert seen["all_reduce"] == [0.0, 1.0, 2.0, 3.0]  # a world of one: the sum is the tensor
    assert seen["gathered"] == [{"rank": 0}]
    assert (seen["tp"], seen["dp"]) == (1, 1)
