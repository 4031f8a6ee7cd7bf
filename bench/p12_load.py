"""P12: loading a ~1B-parameter GPT from a release-format torch_dist checkpoint.

The release's widths (hidden 2,048, 32 heads in 8 groups, SwiGLU ffn 5,632, RoPE, RMSNorm, biases,
untied vocab 130,304 padded to 130,432) with 12 of its 24 layers: 1.07 B parameters, written in
bf16 as the release stores them (TE names, per-layer keys, split SwiGLU, args in common.pt).
Figures, each measured in a fresh process with the files in the page cache:
- load seconds (``load_model``: args → meta-built model → torch_dist) vs the seconds to read the
  same bytes into memory (``Path.read_bytes``, target ≤ 2×); beside it the page-cache copy into a
  reused buffer (no new pages: on these VMs first-touching memory costs ~2.4 s/GiB, most of a
  load), and what random initialisation alone would have cost;
- peak RSS added during the load vs the loaded weights' bytes (target ≤ 1.2×).

``--smoke``: a 2-layer 64-wide model, its four steps (write, read, load, init) in one child process
rather than one fresh process each (each start imports torch and megatron: seconds of CPU).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, args, report


def _arch(layers: int, hidden: int, heads: int, groups: int, ffn: int, text: int) -> object:
    from songserve.pipeline.engine.arch import GPTArch
    from songserve.pipeline.numbers import BACKBONE_LEVELS, CODEBOOK

    vocab = text + BACKBONE_LEVELS * CODEBOOK
    return GPTArch(
        "backbone",
        layers,
        hidden,
        heads,
        ffn,
        text,
        vocab,
        16384,
        4096,
        num_query_groups=groups,
        normalization="RMSNorm",
        norm_epsilon=1e-6,
        position_embedding_type="rope",
        rotary_base=500000,
        gated_linear_unit=True,
        padded_vocab_size=-(-(vocab + 1) // 128) * 128,
    )


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _child(a: Any) -> dict:
    import torch

    from songserve.pipeline.checkpoints.gpt_load import load_model
    from songserve.pipeline.checkpoints.megatron_env import init_megatron
    from songserve.pipeline.engine.gpt import build_model
    from songserve.pipeline.tiny.gpt_write import release_args, save_release_checkpoint

    cpu = torch.device("cpu")
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    init_megatron(cpu, 0, seed=0)
    arch = _arch(a.layers, a.hidden, a.heads, a.groups, a.ffn, a.text)
    path = Path(a.dir)
    if "," in a.child:  # the smoke's steps, one after the other in this process
        got: dict = {}
        for kind in a.child.split(","):
            a.child = kind
            got[kind] = _child(a)
        return got
    if a.child == "write":
        model = build_model(arch, cpu, torch.bfloat16, init=False)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.02)
        save_release_checkpoint(path, model, release_args(arch))
        return {"params": sum(p.numel() for p in model.parameters())}
    if a.child == "read":
        files = sorted((path / "iter_0000001").iterdir())
        t0, n = time.perf_counter(), 0
        for f in files:  # what reading the bytes into memory costs: f.read(), fresh pages included
            n += len(f.read_bytes())
        fresh = time.perf_counter() - t0
        buf = bytearray(64 << 20)
        t0 = time.perf_counter()
        for f in files:  # the page-cache copy alone, into one reused buffer
            with open(f, "rb", buffering=0) as fh:
                while fh.readinto(buf):
                    pass
        return {"read_sec": fresh, "copy_sec": time.perf_counter() - t0, "bytes": n}
    if a.child == "init":
        t0 = time.perf_counter()
        build_model(arch, cpu, dtype, init=True)
        return {"init_sec": time.perf_counter() - t0}
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS mark to the current RSS
    rss0 = _status("VmRSS")
    t0 = time.perf_counter()
    gpt = load_model(path, cpu, dtype, kind="backbone")
    sec = time.perf_counter() - t0
    weights = sum(p.numel() * p.element_size() for p in gpt.model.parameters())
    return {"load_sec": sec, "peak_added": _status("VmHWM") - rss0, "weights": weights}


def _run(a: Any, child: str, folder: Path) -> dict:
    cmd = [sys.executable, "-m", "bench.p12_load", "--child", child, "--dir", str(folder)]
    for k in ("layers", "hidden", "heads", "groups", "ffn", "text", "dtype"):
        cmd += [f"--{k}", str(getattr(a, k))]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"p12 {child} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    a = args(__doc__, child="", dir="", layers=12, hidden=2048, heads=32, groups=8, ffn=5632, text=128256, dtype="bf16")
    if a.child:
        import torch

        torch.set_num_threads(1 if a.smoke else torch.get_num_threads())
        print(json.dumps(_child(a)))
        return
    if a.smoke:
        a.layers, a.hidden, a.heads, a.groups, a.ffn, a.text = 2, 64, 4, 2, 176, 1024
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "backbone"
        if a.smoke:
            got = _run(a, "write,read,load,init", folder)
            params, read, load, init = got["write"]["params"], got["read"], got["load"], got["init"]
        else:
            params = _run(a, "write", folder)["params"]
            read = _run(a, "read", folder)
            load = _run(a, "load", folder)
            init = _run(a, "init", folder)
    ratio = load["load_sec"] / max(read["read_sec"], 1e-9)
    mem = load["peak_added"] / load["weights"]
    report(
        "P12",
        f"{params / 1e9:.2f}B-param GPT ({a.dtype}, {read['bytes'] / 2**30:.2f} GiB torch_dist): load "
        f"{load['load_sec']:.2f}s vs read {read['read_sec']:.2f}s = {ratio:.2f}x (target <= 2x; copy into a reused "
        f"buffer {read['copy_sec']:.2f}s); peak RSS added "
        f"{load['peak_added'] / 2**30:.2f} GiB = {mem:.2f}x the weights (target <= 1.2x); random init alone "
        f"would add {init['init_sec']:.2f}s",
    )


if __name__ == "__main__":
    main()
