"""Our real worker, whose takes start ``SONGSERVE_LATE_SEC`` after their request arrives.

    SONGSERVE_LATE_SEC=1.5 python tests/support/late_worker.py [any worker flag]

A dispatcher marks a track generating, with its task id, before its request reaches the worker; on
a loaded machine the request can take a while to get there. A listener who asks for the track's
live audio in that gap reaches a worker that does not know the task yet. This wrapper makes the gap
a fact the test controls, instead of a race it might lose: each take is registered on the worker
only after the delay (its request is held before the runtime sees it).
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def start_takes_late(seconds: float) -> None:
    from songserve.worker.runtime import WorkerRuntime

    one = WorkerRuntime._generate

    async def late(self: WorkerRuntime, bodies: list) -> list:  # type: ignore[type-arg]
        await asyncio.sleep(seconds)
        return await one(self, bodies)

    WorkerRuntime._generate = late  # type: ignore[method-assign]


if __name__ == "__main__":
    from songserve.worker.main import main

    start_takes_late(float(os.environ["SONGSERVE_LATE_SEC"]))
    sys.exit(main())
