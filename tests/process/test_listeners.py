"""Listeners as a hostile or busy public drives them, through real processes.

A real dispatcher over a real tone worker (its live audio is its tone, written during the first third
of ``--test-delay-s``): MP3 listeners that hang up at random moments must never take the dispatcher
down, and a crowd of listeners on one running track must never cost the track an attempt (the
workers' health polls have connections of their own). Each test prints what it measured.
"""

from __future__ import annotations

import contextlib
import random
import socket
import struct
import threading
import time
from pathlib import Path

import httpx

from tests.support.http import TLS
from tests.support.load_probe import Crowd
from tests.support.servers import Cluster, wait_for

LONG = {"tags": "pop", "lyrics": "[verse]\nla la", "duration": 1.0, "num_tracks": 1}  # a minute of audio


def hang_up_after(url: str, seconds: float, got: list[int]) -> None:
    """Read ``url``'s stream for ``seconds``, then reset the connection (what a closed tab does, at worst)."""
    host, port = url.removeprefix("http://").split("/", 1)[0].split(":")
    path = "/" + url.removeprefix("http://").split("/", 1)[1]
    read = 0
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        sock.settimeout(0.1)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                data = sock.recv(1 << 16)
            except TimeoutError:
                continue
            if not data:
                break
            read += len(data)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a RST
    got.append(read)


def test_mp3_listeners_that_hang_up_at_any_moment_leave_the_dispatcher_serving(tmp_path: Path) -> None:
    rng = random.Random(35)
    with Cluster(tmp_path, workers=1, delay=6.0) as c:
        for round_ in range(6):
            job = c.submit(**LONG, seed=round_)["job_id"]
            url = f"{c.url}/job/{job}/track/0/stream"
            wait_for(lambda: c.job(job)["tracks"][0]["status"] == "generating", timeout=30)  # noqa: B023
            got: list[int] = []
            listeners = [
                threading.Thread(target=hang_up_after, args=(url, rng.uniform(0.3, 1.2), got), daemon=True)
                for _ in range(20)
            ]
            for t in listeners:
                t.start()
            for t in listeners:
                t.join(30)
            served = serving(c)
            print(f"\nround {round_}: 20 listeners read {sum(got) / 2**20:.1f} MiB of MP3; dispatcher: {served}")
            assert served == "serving", c.api.log_tail() if c.api else ""
            assert c.wait_job(job, timeout=60)["status"] == "completed"
            assert serving(c) == "serving"


def serving(c: Cluster) -> str:
    """ "serving" when the dispatcher answers /health, else how it ended (its exit code, e.g. -11 for SIGSEGV)."""
    assert c.api is not None
    try:
        ok = httpx.get(c.url + "/health", timeout=10, verify=TLS).status_code == 200
    except httpx.HTTPError as exc:
        ok, why = False, type(exc).__name__
    else:
        why = "not 200"
    if ok:
        return "serving"
    try:
        code = c.api.proc.wait(5)
    except Exception:  # still running, but not answering
        return f"not answering ({why})"
    return f"exited with {code}"


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    """A process's resident memory now (``VmHWM``: its peak so far), from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} for {pid}")


def test_two_hundred_listeners_on_a_running_track_cost_it_nothing(tmp_path: Path) -> None:
    """The track is not stopped or made twice, no worker is judged offline, the dispatcher answers and
    its memory stays bounded while 200 MP3 listeners hear the track from its start to its end."""
    with Cluster(tmp_path, workers=2, delay=20.0) as c:
        assert c.api is not None
        job = c.submit(**{**LONG, "duration": 0.5}, seed=200)["job_id"]
        wait_for(lambda: c.job(job)["tracks"][0]["status"] == "generating", timeout=30)
        pid = c.api.proc.pid
        before = peak = rss_mib(pid)
        crowd = Crowd(f"{c.url}/job/{job}/track/0/stream", 200)
        slowest = 0.0
        health = httpx.Client(timeout=60, verify=TLS)  # one client: a new one costs the test process ~0.2 s here
        while crowd.listening:
            started = time.monotonic()
            assert health.get(c.url + "/health").status_code == 200
            slowest = max(slowest, time.monotonic() - started)
            peak = max(peak, rss_mib(pid))
            time.sleep(0.2)
        done = c.wait_job(job, timeout=120)
        peak = max(peak, rss_mib(pid, "VmHWM"))  # no peak missed between two samples
        track = done["tracks"][0]
        offline = [line for line in c.api.log_tail(10_000_000).splitlines() if ") offline: " in line]
        statuses = crowd.statuses()
        print(
            f"\n200 listeners: {statuses.count(200)} answered 200, {crowd.whole()} streams whole; "
            f"attempts {track['attempts']}, workers judged offline {len(offline)} times, slowest /health "
            f"{slowest:.2f} s, dispatcher RSS {before:.0f} → peak {peak:.0f} MiB (+{peak - before:.0f})"
        )
        assert done["status"] == "completed"
        assert track["attempts"] == 1
        assert not offline, offline
        assert slowest < 2.0
        assert peak - before < 300
        assert statuses == [200] * 200
        assert crowd.whole() == 200


def test_listeners_past_the_caps_get_a_503_with_retry_after_and_their_places_come_back(tmp_path: Path) -> None:
    caps = ("--live-listeners-per-track", "2", "--live-listeners-max", "3")
    with Cluster(tmp_path, workers=1, delay=20.0, api_args=caps) as c, httpx.Client(timeout=10, verify=TLS) as http:
        a, b = (c.submit(**LONG, seed=seed)["job_id"] for seed in (1, 2))  # b waits in the queue: still listenable
        url_a, url_b = (f"{c.url}/job/{j}/track/0/stream" for j in (a, b))
        with contextlib.ExitStack() as held:
            for url, cap in (
                (url_a, ""),
                (url_a, ""),
                (url_a, "LIVE_LISTENERS_PER_TRACK"),
                (url_b, ""),
                (url_b, "LIVE_LISTENERS_MAX"),
            ):
                r = held.enter_context(http.stream("GET", url))
                if not cap:
                    assert r.status_code == 200
                    continue
                r.read()
                assert (r.status_code, r.headers.get("retry-after")) == (503, "5"), r.text
                assert cap in r.json()["error"]

        def listens(url: str) -> bool:
            with http.stream("GET", url) as r:
                return r.status_code == 200

        wait_for(lambda: listens(url_a), timeout=30)  # the places come back as their listeners go
        assert http.head(url_a).status_code == 200  # HEAD takes no place
        for j in (a, b):
            assert http.delete(f"{c.url}/job/{j}").status_code == 200
