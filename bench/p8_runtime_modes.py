"""P8: latency of the second request, keep_loaded and park vs one_shot (tiny set, real worker processes).

Baseline in the same run: one_shot, which loads super-resolution and decoder for every request.
park keeps them in host memory and moves them to the device per stage (on the CPU a no-op move:
its figure there is the bookkeeping; on a GPU, the host→device copy); "park+backbone" also parks
the backbone while they run (``PARK_BACKBONE=1``: on a GPU one more copy back per request).

``--smoke``: 0.5 s of audio, one_shot and park+backbone only: each mode is a worker start (torch and
megatron imported, seconds of CPU), and keep_loaded and plain park run the same lines with other flags.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import httpx

from bench.common import args, report
from tests.support.servers import start_worker


def second_request(mode: str, tmp: Path, seconds: float, *extra: str) -> float:
    w = start_worker(tmp, "--runtime-mode", mode, *extra, name=mode)
    try:
        w.wait_healthy(timeout=300)
        body = {"lyrics": "hello", "duration": seconds / 60, "seed_override": 1}
        httpx.post(w.url + "/generate", json=body, timeout=300).raise_for_status()
        t0 = time.perf_counter()
        httpx.post(w.url + "/generate", json=body, timeout=300).raise_for_status()
        return time.perf_counter() - t0
    finally:
        w.stop()


# label: (runtime mode, extra worker flags), each measured against one_shot
MODES = {
    "keep_loaded": ("keep_loaded", ()),
    "park": ("park", ()),
    "park+backbone": ("park", ("--park-backbone", "1")),
}


def main() -> None:
    a = args(__doc__, seconds=10.0)
    seconds = 0.5 if a.smoke else a.seconds
    modes = {k: v for k, v in MODES.items() if k == "park+backbone"} if a.smoke else MODES
    with tempfile.TemporaryDirectory() as tmp:
        one = second_request("one_shot", Path(tmp), seconds)
        got = {label: second_request(mode, Path(tmp), seconds, *extra) for label, (mode, extra) in modes.items()}
    ratios = ", ".join(f"{label} {t / one:.2f}x" for label, t in got.items())
    times = ", ".join(f"{t:.2f}" for t in got.values())
    report(
        "P8",
        f"second request, {seconds:g}s audio: {ratios} of one_shot ({times} vs {one:.2f} s; "
        "the tiny set loads in ~0.2 s, real sets in tens of seconds)",
    )


if __name__ == "__main__":
    main()
