"""P1: dispatcher overhead per track (submit → done → download), test pipeline with no delay.

Baseline in the same run: the same work calling the worker directly (POST /generate, download).
``--smoke``: one warm-up and one timed track, the dispatcher and worker served in threads of this process
(tests/support/in_thread.py: the same apps, no process starts).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import Timer, args, median, report
from tests.support.servers import Cluster, free_port

# 0.06 s of audio: the worker's own work (MP3 encoding) stays small, so the figure is the
# dispatcher's overhead rather than two cores shared by three busy processes.
DURATION = 0.001


def through_dispatcher(http: httpx.Client, c: Cluster) -> float:
    with Timer() as t:
        job_id = http.post("/generate", json={"lyrics": "x", "duration": DURATION, "num_tracks": 1}).json()["job_id"]
        with http.stream("GET", f"/job/{job_id}/events") as events:  # done without polling lag
            for line in events.iter_lines():
                if line.startswith("data: ") and json.loads(line[6:])["status"] == "completed":
                    break
        for kind in ("wav", "mp3"):
            http.get(f"/job/{job_id}/track/0/{kind}").raise_for_status()
    return t.sec


def direct(http: httpx.Client, worker_url: str, n: int) -> float:
    with Timer() as t:
        r = http.post(f"{worker_url}/generate", json={"lyrics": "x", "duration": DURATION, "seed_override": n}).json()
        for kind in ("wav", "mp3"):
            http.get(f"{worker_url}/download/{r[kind + '_filename']}").raise_for_status()
    # Untimed: the dispatcher saw the worker busy with our direct call; wait for its next health
    # poll to see it idle, as it would in service (where only the dispatcher calls the worker).
    while http.get("/status").json()["idle_gpus"] != 1:
        time.sleep(0.01)
    return t.sec


def main() -> None:
    a = args(__doc__, tracks=40, acestep=0)
    n, warm = (1, 1) if a.smoke else (a.tracks, 2)
    # --acestep 1: the dispatcher also serves ACE-Step's dialect on a second port (our port's figure with it on)
    ace = ("--acestep-port", str(free_port())) if a.acestep else ()
    with tempfile.TemporaryDirectory() as tmp:
        c = Cluster(Path(tmp), workers=1, delay=0.0, api_args=("--min-duration", str(DURATION), *ace), threads=a.smoke)
        try:
            with httpx.Client(base_url=c.url, timeout=60) as http:
                for i in range(warm):  # warm both paths
                    through_dispatcher(http, c)
                    direct(http, c.workers[0].url, i)
                d, b = [], []
                for i in range(n):  # interleaved, so drift hits both alike
                    d.append(through_dispatcher(http, c))
                    b.append(direct(http, c.workers[0].url, 100 + i))
        finally:
            c.stop()
    md, mb = median(d), median(b)
    report(
        "P1",
        f"dispatcher overhead: +{(md - mb) * 1000:.1f} ms median per track "
        f"(dispatcher {md * 1000:.1f} ms vs direct {mb * 1000:.1f} ms, ratio {md / mb:.2f}x; {n} tracks of {DURATION * 60:.2f} s audio{', ACESTEP_PORT set' if a.acestep else ''})",
    )


if __name__ == "__main__":
    main()
