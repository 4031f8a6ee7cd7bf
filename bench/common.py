"""Shared helpers for the benchmarks: argument parsing, timing, process start-up, one summary line."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
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


async def timed_load(
    url: str, call: Callable[..., Awaitable[object]], seconds: float, conns: int, **client: object
) -> float:
    """Requests/s of ``conns`` loops of ``await call(http, rng)`` (each checks its own answer) for ``seconds``.

    The clock starts once the client is made, and each loop sends at least one request: a smoke run's
    0.2 s can pass before a loaded machine sends one (a rate of zero)."""
    import random

    import httpx

    done = 0
    async with httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=conns), **client) as http:

        async def one() -> None:
            nonlocal done
            rng = random.Random()
            while True:
                await call(http, rng)
                done += 1
                if time.perf_counter() >= stop:
                    break

        t0 = time.perf_counter()
        stop = t0 + seconds
        await asyncio.gather(*(one() for _ in range(conns)))
        return done / (time.perf_counter() - t0)
