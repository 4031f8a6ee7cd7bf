"""Shared helpers for the benchmarks: argument parsing, timing, process start-up, one summary line."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def args(description: str, **defaults: object) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--smoke", action="store_true", help="tiny inputs: check that the script runs")
    for name, value in defaults.items():
        ap.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    return ap.parse_args()


def median(xs: list[float]) -> float:
    return statistics.median(xs)


class Timer:
    def __enter__(self) -> Timer:
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.sec = time.perf_counter() - self.t0


def report(pid: str, line: str) -> None:
    """The one summary line each benchmark prints (bench/run_all collects them)."""
    print(f"{pid} {line}", flush=True)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0
