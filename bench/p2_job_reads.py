"""P2: GET /job/{id} requests/s with 1,000 finished jobs stored.

Baseline in the same run: a bare FastAPI endpoint returning a constant, same uvicorn settings,
same load generator (asyncio + httpx, 16 connections, fixed time).
``--smoke``: 10 jobs, one round of 0.2 s each.
"""

from __future__ import annotations

import asyncio
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import ROOT, args, report, timed_load
from tests.support.servers import ServerProcess, free_port


def seed_store(state: Path, n: int) -> list[str]:
    """Write n finished 2-track jobs through the job store itself (as the dispatcher would)."""
    return asyncio.run(_seed(state, n))


async def _seed(state: Path, n: int) -> list[str]:
    from songserve.api.jobs.records import Job, Track
    from songserve.api.jobs.states import TrackStatus
    from songserve.api.store.sqlite.store import SqliteStore
    from songserve.schemas import GenerateRequest

    store = SqliteStore(state / "jobs.sqlite3")
    ids = []
    now = time.time()
    for i in range(n):
        job_id = f"{i:016x}"
        tracks = [
            Track(
                job_id,
                k,
                1000 + k,
                status=TrackStatus.done,
                attempts=1,
                worker_id=k,
                duration_sec=180.0,
                started_at=now - 60,
                finished_at=now,
                metadata={
                    "models": {"backbone": "default_backbone"},
                    "timings": {"backbone_sec": 30.0, "superres_sec": 10.0},
                },
            )
            for k in range(2)
        ]
        request = GenerateRequest(duration=3.0, num_tracks=2, tags="pop", lyrics="la la")
        job = Job(job_id, i + 1, now - 100, request, "la la", tracks)
        await store.insert_job(job)
        for t in tracks:
            await store.save_track(t, (TrackStatus.done, None))
        await store.finish_job(job_id, now)
        ids.append(job_id)
    await store.close()
    return ids


def wrk_load(url: str, ids: list[str], seconds: float, tmp: Path, conns: int = 32) -> float:
    """Requests/s measured by wrk (one thread), random stored ids."""
    script = tmp / "ids.lua"
    listed = ",".join(f'"{i}"' for i in ids)
    script.write_text(
        f"ids = {{{listed}}}\nrequest = function()\n"
        '  return wrk.format("GET", "/job/" .. ids[math.random(#ids)])\nend\n'
    )
    out = subprocess.run(
        ["wrk", "-t1", f"-c{conns}", f"-d{max(1, int(seconds))}s", "-s", str(script), url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    if "Non-2xx" in out:
        raise RuntimeError(f"wrk saw errors:\n{out}")
    return float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))


async def load(url: str, ids: list[str], seconds: float, conns: int = 16) -> float:
    async def get(http: httpx.AsyncClient, rng: random.Random) -> None:
        r = await http.get(f"/job/{rng.choice(ids)}")
        assert r.status_code == 200

    return await timed_load(url, get, seconds, conns)


def main() -> None:
    a = args(__doc__, jobs=1000, seconds=8.0, acestep=0)  # --acestep 1: ACESTEP_PORT set on the dispatcher
    n, secs, rounds = (10, 0.2, 1) if a.smoke else (a.jobs, a.seconds, 2)
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp) / "state"
        ids = seed_store(state, n)
        port = free_port()
        ours = ServerProcess(
            [
                "backend_api.py",
                "--port",
                str(port),
                "--state-dir",
                str(state),
                "--num-workers",
                "0",
                "--log-level",
                "WARNING",
                *(("--acestep-port", str(free_port())) if a.acestep else ()),
            ],
            port,
            Path(tmp) / "api.log",
        )
        bport = free_port()
        bare = ServerProcess(
            ["-m", "uvicorn", "bench.bare_app:app", "--port", str(bport), "--log-level", "warning"],
            bport,
            Path(tmp) / "bare.log",
        )
        try:
            ours.wait_healthy(timeout=300, want=("ok",))
            import httpx as h

            for _ in range(100):
                try:
                    h.get(bare.url + "/job/x")
                    break
                except h.HTTPError:
                    time.sleep(0.1)
            rates = {"ours": [], "bare": []}
            tool = "wrk, 32 connections" if shutil.which("wrk") else "asyncio+httpx, 16 connections"
            for _ in range(rounds):  # alternate to share the machine's drift
                for name, server in (("ours", ours), ("bare", bare)):
                    if shutil.which("wrk"):
                        rates[name].append(wrk_load(server.url, ids, secs, Path(tmp)))
                    else:
                        rates[name].append(asyncio.run(load(server.url, ids, secs)))
        finally:
            ours.stop()
            bare.stop()
    o, b = max(rates["ours"]), max(rates["bare"])
    report(
        "P2",
        f"GET /job/{{id}}: {o / b:.2f}x of a bare endpoint ({o:.0f} vs {b:.0f} req/s, {n} jobs stored, load by {tool}{', ACESTEP_PORT set' if a.acestep else ''})",
    )


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
