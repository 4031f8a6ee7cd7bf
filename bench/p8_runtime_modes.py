"""P8: latency of the second request, keep_loaded and park vs one_shot (tiny set, real worker processes).

Baseline in the same run: one_shot, which loads super-resolution and decoder for every request.
park keeps them in host memory and moves them to the device per stage (on the CPU a no-op move:
its figure there is the bookkeeping; on a GPU, the host→device copy); "park+backbone" also parks
the backbone while they run (``PARK_BACKBONE=1``: on a GPU one more copy back per request).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import httpx

from bench.common import args, report
from tests.support import start_worker


def second_request(mode: str, tmp: Path, seconds: float, *extra: str) -> float:
    w = start_worker(tmp, "--runtime-mode", mode, *extra, name=mode)
    try:
        w.wait_healthy()
        body = {"lyrics": "hello", "duration": seconds / 60, "seed_override": 1}
        httpx.post(w.url + "/generate", json=body, timeout=300).raise_for_status()
        t0 = time.perf_counter()
        httpx.post(w.url + "/generate", json=body, timeout=300).raise_for_status()
        return time.perf_counter() - t0
    finally:
        w.stop()


def main() -> None:
    a = args(__doc__, seconds=10.0)
    seconds = 2.0 if a.smoke else a.seconds
    with tempfile.TemporaryDirectory() as tmp:
        one = second_request("one_shot", Path(tmp), seconds)
        keep = second_request("keep_loaded", Path(tmp), seconds)
        park = second_request("park", Path(tmp), seconds)
        park_bb = second_request("park", Path(tmp), seconds, "--park-backbone", "1")
    report(
        "P8",
        f"second request, {seconds:.0f}s audio: keep_loaded {keep / one:.2f}x, park {park / one:.2f}x, "
        f"park+backbone {park_bb / one:.2f}x of one_shot ({keep:.2f}, {park:.2f}, {park_bb:.2f} vs {one:.2f} s; "
        "the tiny set loads in ~0.2 s, real sets in tens of seconds)",
    )


if __name__ == "__main__":
    main()
