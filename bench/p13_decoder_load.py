"""P13: loading the full-size decoder from a release-shaped Lightning checkpoint.

Writes the release's decoder at full size (n_filters 192, 64 × 1,024 × 128 codebooks; with its
encoder, discriminator and training entries) to a temporary folder, then in fresh processes:
- ``load``: ``load_decoder`` (weights-only, memory-mapped, meta-device build, sliced weight-norm fold),
  timed, with the process's peak RSS during the load (VmHWM reset just before) against the decoder's
  weights in memory;
- ``read``: reading the whole checkpoint file into a buffer (the bytes the load could at most need).
Targets: load ≤ 2× the read, peak RSS growth ≤ 1.2× the weights. One thread, page cache warm for both
(medians over alternating runs).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import ROOT, args, median, report


def _status(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0.0


def child_load(yaml_path: Path, ckpt: Path) -> dict:
    import torch

    from songserve.pipeline.stages.codec import load_decoder

    torch.set_num_threads(1)
    before = _status("VmRSS")
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM, so the peak is the load's own
    except OSError:
        pass
    t0 = time.perf_counter()
    decoder = load_decoder(yaml_path, ckpt, torch.device("cpu"))
    sec = time.perf_counter() - t0
    peak = _status("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    weights = sum(p.numel() * p.element_size() for p in decoder.parameters())
    return {"sec": sec, "peak_growth": peak - before, "weights": weights}


def child_read(ckpt: Path) -> dict:
    buf = bytearray(ckpt.stat().st_size)
    t0 = time.perf_counter()
    with open(ckpt, "rb", buffering=0) as f:
        view, done = memoryview(buf), 0
        while done < len(buf):
            n = f.readinto(view[done:])
            if not n:
                break
            done += n
    return {"sec": time.perf_counter() - t0, "bytes": done}


def _evict(path: Path) -> None:
    """Drop this file's pages from the page cache (this file only; others' caches are untouched)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _run(*argv: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "bench.p13_decoder_load", "--child", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        kind, *paths = sys.argv[2:]
        res = child_load(Path(paths[0]), Path(paths[1])) if kind == "load" else child_read(Path(paths[0]))
        print(json.dumps(res))
        return
    a = args(__doc__, repeats=3)
    from songserve.pipeline.tiny.decoder_release import FULL_SIZES, ReleaseDecoderSizes, write_release_decoder

    sizes = ReleaseDecoderSizes() if a.smoke else FULL_SIZES
    repeats = 1 if a.smoke else a.repeats
    with tempfile.TemporaryDirectory() as tmp:
        yaml_path, ckpt = Path(tmp) / "dac.yaml", Path(tmp) / "dac_rvq.ckpt"
        write_release_decoder(yaml_path, ckpt, sizes=sizes)
        res: dict[str, list[dict]] = {"warm_read": [], "warm_load": [], "cold_read": [], "cold_load": []}
        for _ in range(repeats):
            for cache in ("cold", "warm"):
                for kind, argv in (("read", [str(ckpt)]), ("load", [str(yaml_path), str(ckpt)])):
                    if cache == "cold":
                        _evict(ckpt)
                    else:
                        _run("read", str(ckpt))
                    res[f"{cache}_{kind}"].append(_run(kind, *argv))
        size = ckpt.stat().st_size
    sec = {k: median([r["sec"] for r in v]) for k, v in res.items()}
    loads = res["warm_load"] + res["cold_load"]
    weights = loads[0]["weights"]
    peak = median([r["peak_growth"] for r in loads])
    report(
        "P13",
        f"decoder load ({'tiny' if a.smoke else 'full size'}, {weights / 2**20:.0f} MiB weights, "
        f"{size / 2**20:.0f} MiB file): cold cache {sec['cold_load']:.2f} s vs {sec['cold_read']:.2f} s to read "
        f"the file = {sec['cold_load'] / sec['cold_read']:.2f}x; warm {sec['warm_load']:.2f} s vs "
        f"{sec['warm_read']:.2f} s = {sec['warm_load'] / sec['warm_read']:.2f}x (target <= 2x); "
        f"peak RSS growth {peak / 2**20:.0f} MiB = {peak / weights:.2f}x the weights (target <= 1.2x)",
    )


if __name__ == "__main__":
    main()
