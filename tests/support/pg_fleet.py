"""Dispatchers sharing one PostgreSQL store over tone workers, as real processes: how the scale-out,
split-brain, webhook and live-audio tests start and read them (``backend_api.py`` with ``STORE_URL``)."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.support.http import TLS
from tests.support.servers import ServerProcess, free_port, start_worker, wait_for

TERMINAL = {"completed", "partial", "failed", "cancelled"}
TOKEN = "scale-out-token"


def start_dispatcher(tmp: Path, name: str, store_url: str, workers: list[ServerProcess], *extra: str) -> ServerProcess:
    port = free_port()
    urls = ",".join(w.url for w in workers)
    args = [
        "backend_api.py",
        "--port", str(port),
        "--state-dir", str(tmp / f"state_{name}"),
        "--results-dir", str(tmp / "shared_results"),  # the "network volume" both dispatchers mount
        "--store-url", store_url,
        "--dispatcher-id", name,
        "--lease-ttl-sec", "3",
        "--health-interval", "0.2",
        *(("--worker-urls", urls) if urls else ("--num-workers", "0")),
        *extra,
    ]  # fmt: skip
    api = ServerProcess(args, port, tmp / f"api_{name}.log", env={"WORKER_TOKEN": TOKEN})
    api.wait_healthy(want=("ok",))
    return api


def tone_workers(tmp: Path, n: int, delay: float, *extra: str) -> list[ServerProcess]:
    ws = [
        start_worker(
            tmp, "--pipeline", "test", "--test-delay-s", str(delay), *extra, name=f"w{i}", env={"WORKER_TOKEN": TOKEN}
        )
        for i in range(n)
    ]
    for w in ws:
        w.wait_healthy()
    return ws


def generated(workers: list[ServerProcess]) -> int:
    return sum(w.log_tail(10_000_000).count(": done in ") for w in workers)


def job(api: ServerProcess, job_id: str) -> dict:
    return httpx.get(f"{api.url}/job/{job_id}", timeout=10, verify=TLS).json()


def wait_done(api: ServerProcess, job_id: str, timeout: float = 60) -> dict:
    return wait_for(lambda: (j := job(api, job_id))["status"] in TERMINAL and j, timeout=timeout, interval=0.1)


def status(api: ServerProcess) -> dict:
    return httpx.get(api.url + "/status", timeout=10, verify=TLS).json()


def stop_all(*procs: ServerProcess) -> None:
    for p in procs:
        p.stop()
