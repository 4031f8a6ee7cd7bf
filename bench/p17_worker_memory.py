"""P17: a model worker's memory over many jobs of each kind, with the host-memory settings and without.

Real processes: for each series a fresh tiny-set worker (keep_loaded, ``KV_SNAPSHOT_MB=0`` so the
snapshot cache is out of the picture) behind a fresh dispatcher, one job at a time, the worker's
RSS read from ``/proc`` after each job. Each series runs twice, interleaved: with the worker's
defaults (``after``) and with oneDNN's and glibc's own (``before``: ``ONEDNN_PRIMITIVE_CACHE_CAPACITY``
1024, ``MALLOC_TRIM`` 0; ``worker/host_memory.py`` says why they grow a worker).

The figures per series and setting: RSS after the first job, after the warm-up (``--warmup`` jobs),
at the end, and the growth after the warm-up scaled to 100 jobs; the peak (``VmHWM``); the mean
seconds per job, and after/before as a ratio measured in the same run (the cost of building oneDNN
kernels again and of trimming the heap).

Series: ``plain`` 1-take 6 s; ``preview`` 1-take 6 s with live audio; ``two_take`` 2-take 3-12 s;
``retake`` retakes of one 12 s take from random seconds; ``upload`` continuations of one upload;
``live2`` 2-take 12 s with live audio; ``listened`` the same with an MP3 listener on each take that
hangs up after 0.3-1.2 s; ``cancelled`` the same, every other job cancelled 1-3 s in.

``--smoke``: the ``listened`` series, 3 jobs of 2 s, with the defaults only.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import args, report, rss_mb
from tests.support.servers import Cluster, cluster_of, start_worker

TERMINAL = {"completed", "partial", "failed", "cancelled"}
SETTINGS = {
    "after": [],
    "before": ["--onednn-primitive-cache-capacity", "1024", "--malloc-trim", "0"],
}
SONG = {"tags": "pop, piano", "lyrics": "[verse]\nround and round\nit goes"}


def peak_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def submit(site: Cluster, body: dict[str, Any]) -> str:
    r = httpx.post(f"{site.url}/generate", json=body, timeout=30)
    r.raise_for_status()
    return str(r.json()["job_id"])


def wait(site: Cluster, job: str) -> dict[str, Any]:
    with httpx.Client(base_url=site.url, timeout=30) as http:
        while (view := http.get(f"/job/{job}").json())["status"] not in TERMINAL:
            time.sleep(0.1)
    return dict(view)


def hang_up(site: Cluster, job: str, track: int, after: float) -> None:
    """An MP3 listener that leaves after ``after`` seconds, as a closed browser tab does."""
    deadline = time.monotonic() + after
    try:
        with httpx.stream("GET", f"{site.url}/job/{job}/track/{track}/stream", timeout=30) as r:
            for _ in r.iter_raw():
                if time.monotonic() > deadline:
                    return
    except httpx.HTTPError:
        pass


class Series:
    """One kind of job, drawn from a seeded generator; ``first`` prepares what later jobs continue."""

    def __init__(self, kind: str, seconds: float, rng: random.Random) -> None:
        self.kind, self.seconds, self.rng = kind, seconds, rng
        self.source: dict[str, Any] = {}

    def prepare(self, site: Cluster) -> None:
        if self.kind == "retake":
            job = submit(site, {**SONG, "duration": self.seconds / 60, "num_tracks": 1, "seed": 1})
            assert wait(site, job)["status"] == "completed"
            self.source = {"job_id": job, "track_index": 0}
        if self.kind == "upload":
            from tests.model.test_encoder import music, wav_bytes

            data = wav_bytes(music(self.seconds / 2, seed=3))
            r = httpx.post(f"{site.url}/uploads", files={"file": ("p17.wav", data, "audio/wav")}, timeout=120)
            r.raise_for_status()
            upload = r.json()["upload_id"]
            self.source = {"upload_id": upload}
            deadline = time.monotonic() + 300
            while httpx.get(f"{site.url}/uploads/{upload}", timeout=10).json().get("status") != "ready":
                assert time.monotonic() < deadline, "the upload was never encoded"
                time.sleep(0.2)

    def one(self, site: Cluster, i: int) -> None:
        rng, kind, sec = self.rng, self.kind, self.seconds
        body: dict[str, Any] = {**SONG, "seed": rng.randrange(1, 10_000), "duration": sec / 60, "num_tracks": 1}
        if kind == "preview":
            body["preview"] = True
        if kind == "two_take":
            body.update(num_tracks=2, duration=rng.uniform(sec / 4, sec) / 60)
        if kind == "retake":
            body["continue_from"] = {**self.source, "at_sec": round(rng.uniform(1.0, sec - 1.0), 2)}
        if kind == "upload":
            body["continue_from"] = dict(self.source)
        if kind in ("live2", "listened", "cancelled"):
            body.update(num_tracks=2, preview=True)
        job = submit(site, body)
        listeners = []
        if kind in ("listened", "cancelled"):
            for track in range(2):
                t = threading.Thread(target=hang_up, args=(site, job, track, rng.uniform(0.3, 1.2)), daemon=True)
                t.start()
                listeners.append(t)
        if kind == "cancelled" and i % 2:
            time.sleep(rng.uniform(1.0, 3.0))
            httpx.delete(f"{site.url}/job/{job}", timeout=30).raise_for_status()
        view = wait(site, job)
        assert view["status"] in ("completed", "cancelled"), view
        for t in listeners:
            t.join(60)


def run_series(tmp: Path, kind: str, setting: str, jobs: int, warmup: int, seconds: float) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(dir=tmp))
    w = start_worker(
        folder,
        "--runtime-mode",
        "keep_loaded",
        "--kv-snapshot-mb",
        "0",
        "--eoa-min-share",
        "1",
        *SETTINGS[setting],
        name=f"p17-{kind}-{setting}",
    )
    site: Cluster | None = None
    try:
        w.wait_healthy(timeout=300)
        site = cluster_of(folder, [w])
        series = Series(kind, seconds, random.Random(f"{kind}-17"))  # the same jobs for both settings
        series.prepare(site)
        pid = w.proc.pid
        loaded = rss_mb(pid)
        rss, sec = [], []
        for i in range(jobs):
            t0 = time.perf_counter()
            series.one(site, i)
            sec.append(time.perf_counter() - t0)
            rss.append(rss_mb(pid))
        peak = peak_mb(pid)
    finally:
        (site or w).stop()
    after_warmup = rss[min(warmup, jobs) - 1]
    per_100 = (rss[-1] - after_warmup) / max(1, jobs - warmup) * 100
    return {
        "loaded": loaded,
        "first": rss[0],
        "warm": after_warmup,
        "end": rss[-1],
        "peak": peak,
        "per_100": per_100,
        "sec": statistics.mean(sec),
        "rss": rss,
    }


def show(r: dict[str, Any]) -> str:
    return (
        f"{r['first']:.0f} -> {r['warm']:.0f} -> {r['end']:.0f} MB (peak {r['peak']:.0f}), "
        f"{r['per_100']:+.0f} MB/100 jobs, {r['sec']:.2f} s/job"
    )


def main() -> None:
    a = args(__doc__, jobs=30, warmup=10, seconds=12.0, series="all")
    kinds = ["plain", "preview", "two_take", "retake", "upload", "live2", "listened", "cancelled"]
    if a.series != "all":
        kinds = a.series.split(",")
    settings = ["before", "after"]
    jobs, warmup, seconds = a.jobs, a.warmup, a.seconds
    if a.smoke:
        kinds, settings, jobs, warmup, seconds = ["listened"], ["after"], 3, 1, 2.0
    rows: list[str] = []
    worst: dict[str, float] = {}
    cost: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in kinds:
            got = {
                s: run_series(Path(tmp), kind, s, jobs, warmup, 6.0 if kind in ("plain", "preview") else seconds)
                for s in settings
            }
            for s, r in got.items():
                rows.append(f"  {kind:9s} {s:6s} loaded {r['loaded']:.0f}: {show(r)}")
                print(rows[-1], flush=True)  # each series as it ends: a long run stopped early still says something
                worst[s] = max(worst.get(s, float("-inf")), r["end"] - r["warm"])
            if len(got) == 2:
                cost.append(got["after"]["sec"] / got["before"]["sec"])
    figures = ", ".join(f"{s}: largest growth after warm-up {worst[s]:+.0f} MB" for s in settings)
    ratio = f"; time per job after/before {statistics.median(cost):.2f}x (median of series)" if cost else ""
    report("P17", f"worker RSS over {jobs} jobs x {len(kinds)} series, warm-up {warmup}: {figures}{ratio}")


if __name__ == "__main__":
    main()
