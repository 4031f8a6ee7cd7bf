"""A crowd of ``Prefer: wait`` clients, each submitting a job of its own and holding its connection
until the dispatcher answers, run in a process of its own so that its thousand coroutines never
slow the test process that measures the dispatcher meanwhile.

``python -m tests.support.waiters URL N WAIT_SEC`` prints the answers' statuses as JSON
(``{"202": 998, "200": 2}``; a request that failed counts under its exception's name).
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections import Counter

import httpx

from tests.support.http import TLS


async def wait_on_jobs(url: str, n: int, wait_sec: int) -> Counter[str]:
    """``n`` clients at once, each ``POST /generate`` with ``Prefer: wait=wait_sec``; their answers' statuses."""
    limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=n + 10)
    async with httpx.AsyncClient(timeout=wait_sec + 120, limits=limits, verify=TLS) as client:

        async def one(i: int) -> str:
            body = {"lyrics": "la", "tags": "pop", "duration": 0.05, "seed": i}
            try:
                r = await client.post(url + "/generate", json=body, headers={"Prefer": f"wait={wait_sec}"})
            except httpx.HTTPError as exc:
                return type(exc).__name__
            return str(r.status_code)

        return Counter(await asyncio.gather(*(one(i) for i in range(n))))


if __name__ == "__main__":
    url, n, wait_sec = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    print(json.dumps(dict(asyncio.run(wait_on_jobs(url, n, wait_sec)))))
