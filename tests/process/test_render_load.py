"""Renders under load, through a real dispatcher and a real tone worker that made a 3-minute take.

Unbounded, 60 concurrent FLAC renders of a 3-minute take (distinct loudness values) cost the
dispatcher +1.3 GiB and both cores for 53 s, and a 1-second upload took 14–21 s meanwhile, because
every render ran at once on the executor uploads share. Here: each of 60 concurrent renders is 200
or 429 with ``Retry-After`` (``RENDER_CONCURRENCY`` run, ``RENDER_QUEUE`` wait), the dispatcher's
peak RSS grows < 1 GiB, a 1-second upload is encoded in < 10 s meanwhile; 30 identical concurrent
requests share one render (all 200 though only a few could wait in line).
"""

from __future__ import annotations

import asyncio
import io
import threading
import time

import httpx
import psutil
import pytest
import soundfile as sf

from tests.support.audio import music, wav_bytes
from tests.support.http import TLS
from tests.support.servers import Cluster, wait_for

RENDERS = 60


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    c = Cluster(
        tmp_path_factory.mktemp("render_load"),
        workers=1,
        delay=0.05,
        api_args=("--render-concurrency", "2", "--render-queue", "4"),
    )
    yield c
    c.stop()


@pytest.fixture(scope="module")
def take(site):
    """A 3-minute tone take: its job id."""
    job = site.submit(tags="pop", lyrics="[verse]\nthree minutes", duration=3.0, num_tracks=1)
    assert site.wait_job(job["job_id"], timeout=300)["status"] == "completed"
    return job["job_id"]


class PeakRss:
    """The highest RSS of a process, sampled every 20 ms on a thread until stopped."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.base = self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def growth_mib(self) -> float:
        self._stop.set()
        self._thread.join()
        return (self.peak - self.base) / 2**20


def upload_seconds(url: str) -> float:
    """POST a 1-second WAV and wait until it is encoded: the seconds it took."""
    t0 = time.monotonic()
    data = wav_bytes(music(1.0))
    r = httpx.post(f"{url}/uploads", files={"file": ("one.wav", data, "audio/wav")}, timeout=120, verify=TLS)
    assert r.status_code == 200, r.text
    upload_id = r.json()["upload_id"]
    view = wait_for(
        lambda: (
            (v := httpx.get(f"{url}/uploads/{upload_id}", timeout=60, verify=TLS).json())["status"]
            not in ("queued", "encoding")
            and v
        ),
        timeout=120,
    )
    assert view["status"] == "ready", view
    return time.monotonic() - t0


async def render_all(url: str, job_id: str, loudness: list[float]) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=len(loudness), max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=limits, verify=TLS) as client:
        return list(
            await asyncio.gather(
                *(
                    client.get(f"{url}/job/{job_id}/track/0/render", params={"format": "flac", "loudness": lu})
                    for lu in loudness
                )
            )
        )


def test_sixty_concurrent_renders_are_bounded_and_an_upload_keeps_its_pace(site, take):
    assert site.api is not None
    httpx.get(
        f"{site.url}/job/{take}/track/0/render", params={"format": "wav", "end": 1}, timeout=60, verify=TLS
    )  # imports
    rss = PeakRss(site.api.proc.pid)
    got: list[httpx.Response] = []
    t0 = time.monotonic()
    runner = threading.Thread(
        target=lambda: got.extend(asyncio.run(render_all(site.url, take, [-40 + 0.5 * i for i in range(RENDERS)])))
    )
    runner.start()
    log = site.api.log_path
    wait_for(lambda: "render refused" in log.read_text(), timeout=120)  # all asked: the upload competes with them
    upload = upload_seconds(site.url)
    runner.join()
    seconds, growth = time.monotonic() - t0, rss.growth_mib()
    codes = [r.status_code for r in got]
    print(
        f"{RENDERS} renders: {codes.count(200)} made, {RENDERS - codes.count(200)} refused, {seconds:.1f} s; "
        f"dispatcher peak RSS +{growth:.0f} MiB; a 1-second upload took {upload:.1f} s"
    )
    assert len(got) == RENDERS
    for r in got:
        assert r.status_code in (200, 429, 503), r.text
        if r.status_code != 200:
            assert int(r.headers["retry-after"]) >= 1
            assert "RENDER_QUEUE" in r.json()["error"]
    made = [r for r in got if r.status_code == 200]
    assert made
    x, rate = sf.read(io.BytesIO(made[0].content))
    assert (rate, x.shape[1]) == (44100, 2)
    assert abs(x.shape[0] / rate - 180.0) < 0.1
    assert growth < 1024
    assert upload < 10.0


def test_identical_concurrent_renders_share_one(site, take):
    got = asyncio.run(render_all(site.url, take, [-7.3] * 30))
    assert [r.status_code for r in got] == [200] * 30  # more than run and wait at once: they share one render
    assert len({r.content for r in got}) == 1
    log = site.api.log_path.read_text() if site.api else ""
    assert log.count(f"job {take} track 0: rendered") >= 1
    made = [line for line in log.splitlines() if "rendered" in line and "-7.3 LUFS" in line]
    assert len(made) == 1, made
