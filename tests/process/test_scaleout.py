"""Several dispatchers on one PostgreSQL store, workers that join and leave, as real processes.

Each test starts its own dispatchers (``backend_api.py`` with ``STORE_URL``) over test-pipeline
workers, on a fresh database of the session's throw-away PostgreSQL server. "Generated once" is
counted in the workers' own logs (one ``: done in `` line per finished task).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import random
import signal
import time

import httpx
import pytest

from songserve.http.keepalive import CLIENT_KEEPALIVE_SEC
from tests.support.http import TLS
from tests.support.pg_fleet import (
    TOKEN,
    generated,
    job,
    start_dispatcher,
    status,
    stop_all,
    tone_workers,
    wait_done,
)
from tests.support.servers import ServerProcess, free_port, wait_for

# Real-process proofs (signals, kill -9, full disks, the launcher, load): one xdist worker runs them in order.
pytestmark = pytest.mark.process


def test_a_job_submitted_at_one_dispatcher_is_polled_and_streamed_at_another(tmp_path, pg_url):
    workers = tone_workers(tmp_path, 3, delay=3.0)  # B sees the tracks generating even on a loaded machine
    a = start_dispatcher(tmp_path, "A", pg_url, workers)
    b = start_dispatcher(tmp_path, "B", pg_url, workers)
    try:
        # Both see all three workers; the leases split them (2 + 1), so no worker gets two tasks.
        def split() -> list[int]:
            owners = [w["leased_by"] for w in status(b)["workers"]]
            return sorted(owners.count(x) for x in ("A", "B"))

        wait_for(lambda: split() == [1, 2], timeout=20)
        assert status(a)["dispatchers"] == ["A", "B"]
        sub = httpx.post(
            a.url + "/generate", json={"lyrics": "hi", "duration": 0.05, "num_tracks": 2}, verify=TLS
        ).json()
        job_id = sub["job_id"]
        assert job(b, job_id)["job_id"] == job_id  # polled at B at once
        events = []
        with httpx.stream("GET", f"{b.url}/job/{job_id}/events", timeout=30, verify=TLS) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
        phases = {t["status"] for e in events for t in e["tracks"]}
        assert events[-1]["status"] == "completed"
        assert "generating" in phases  # B showed the progress of tracks run wherever they ran
        assert (
            httpx.get(f"{b.url}/job/{job_id}/track/0/mp3", verify=TLS).status_code == 200
        )  # any dispatcher serves files
        assert httpx.get(f"{a.url}/job/{job_id}/track/1/wav", verify=TLS).status_code == 200
    finally:
        stop_all(a, b, *workers)


def test_500_tracks_from_50_clients_over_two_dispatchers_none_lost_none_twice(tmp_path, pg_url):
    workers = tone_workers(tmp_path, 3, 0.0, "--test-max-audio-sec", "0.1")  # the schedule is the point
    # Leases of 10 s (the file's others: 3 s): under the suite's load a dispatcher can be kept off a core
    # for seconds, and a lease that lapses meanwhile retries its tracks, which this test counts as twice.
    longer = ("--max-queue", "40", "--lease-ttl-sec", "10")
    apis = [start_dispatcher(tmp_path, n, pg_url, workers, *longer) for n in ("A", "B")]
    try:
        rng = random.Random(0)
        rejections = {"429": 0, "retry_after_missing": 0}

        dropped = []  # connections lost with a request in flight, retried under the same key

        def client(n: int) -> list[str]:
            ids = []
            limits = httpx.Limits(keepalive_expiry=CLIENT_KEEPALIVE_SEC)  # as our own clients do
            with httpx.Client(timeout=30, limits=limits, verify=TLS) as http:
                while len(ids) < 10:
                    api = apis[(n + len(ids)) % 2]  # each client alternates between the dispatchers
                    body = {"lyrics": f"c{n}", "duration": 0.05, "num_tracks": 1}
                    # A socket can still be closed by the server just as a request goes out; a careful
                    # client sends an Idempotency-Key and retries, and the key keeps it to one job.
                    key = {"Idempotency-Key": f"c{n}-{len(ids)}"}
                    try:
                        r = http.post(api.url + "/generate", json=body, headers=key)
                    except httpx.TransportError as exc:
                        dropped.append(repr(exc))
                        r = http.post(api.url + "/generate", json=body, headers=key)
                    if r.status_code == 429:
                        rejections["429"] += 1
                        rejections["retry_after_missing"] += "retry-after" not in r.headers
                        time.sleep(min(float(r.headers.get("retry-after", 1)), 0.5) * rng.random() + 0.05)
                        continue
                    assert r.status_code == 200, r.text
                    ids.append(r.json()["job_id"])
            return ids

        with cf.ThreadPoolExecutor(50) as pool:
            accepted = [j for ids in pool.map(client, range(50)) for j in ids]
        assert len(accepted) == 500 == len(set(accepted))
        assert len(dropped) < 10, dropped  # a rare race, not a dispatcher that drops connections
        jobs = [wait_done(apis[i % 2], j, timeout=300) for i, j in enumerate(accepted)]
        assert all(j["status"] == "completed" for j in jobs)
        assert rejections["429"] > 0
        assert rejections["retry_after_missing"] == 0
        again = [(j["job_id"], t["index"], t["attempts"]) for j in jobs for t in j["tracks"] if t["attempts"] != 1]
        leases = [ln for api in apis for ln in api.log_tail(200_000).splitlines() if "lease" in ln and "WARNING" in ln]
        assert not again, (again, leases[-10:])
        assert generated(workers) == 500  # 0 generated twice
        ran_at = {w: 0 for w in ("A", "B")}
        for api in apis:
            for line in api.log_tail(10_000_000).splitlines():
                if ": attempt 1 on worker" in line:
                    ran_at[api is apis[1] and "B" or "A"] += 1
        assert ran_at["A"] > 0
        assert ran_at["B"] > 0  # both dispatchers ran tracks
        assert sum(ran_at.values()) == 500
    finally:
        stop_all(*apis, *workers)


def one_each(api: ServerProcess) -> list[str] | None:
    """The workers' lease holders as ``api`` sees them, once A and B hold one each; else None. A worker
    between holders (A gave it back, B has not taken it yet) has none (``leased_by`` null): not yet."""
    owners = [w["leased_by"] for w in httpx.get(api.url + "/status", verify=TLS).json()["workers"]]
    return owners if len(owners) == 2 and owners.count("A") == 1 and owners.count("B") == 1 else None


def test_a_dispatcher_joining_a_busy_fleet_gets_its_share_of_workers(tmp_path, pg_url):
    """A holds both workers and keeps them busy; B joins: A hands one lease back when that worker's
    task ends (no new task goes to it meanwhile), and B runs part of the remaining queue."""
    workers = tone_workers(tmp_path, 2, delay=1.0)
    a = start_dispatcher(tmp_path, "A", pg_url, workers)
    b = None
    try:
        wait_for(
            lambda: all(w["leased_by"] == "A" for w in httpx.get(a.url + "/status", verify=TLS).json()["workers"]), 30
        )
        ids = [
            httpx.post(
                a.url + "/generate", json={"lyrics": f"q{i}", "duration": 0.05, "num_tracks": 1}, verify=TLS
            ).json()["job_id"]
            for i in range(16)
        ]  # 8 s of work on two workers, never idle between tracks
        wait_for(
            lambda: all(w["status"] == "busy" for w in httpx.get(a.url + "/status", verify=TLS).json()["workers"]), 30
        )
        b = start_dispatcher(tmp_path, "B", pg_url, workers)
        owners = wait_for(lambda: one_each(b), timeout=30, interval=0.2)
        assert sorted(owners) == ["A", "B"]
        jobs = [wait_done(a, j) for j in ids]
        assert all(j["status"] == "completed" for j in jobs)
        assert all(t["attempts"] == 1 for j in jobs for t in j["tracks"])
        assert b.log_tail(1_000_000).count(": attempt 1 on worker") > 0  # B ran part of A's queue
        assert "lease goes back once its tasks end" in a.log_tail(1_000_000)
        assert generated(workers) == 16
    finally:
        stop_all(*([b] if b else []), a, *workers)


def test_kill_9_of_a_dispatcher_hands_its_queued_and_running_tracks_to_another(tmp_path, pg_url):
    # The first three tracks wait on the hold file until B has taken them over (TEST_HOLD_FILE): B's
    # start-up and the checks before the kill need no round long enough for a loaded machine (it was
    # 15 s a track, 45 s a test).
    hold = tmp_path / "hold"
    hold.touch()
    workers = tone_workers(tmp_path, 3, 0.5, "--test-hold-file", str(hold))
    a = start_dispatcher(tmp_path, "A", pg_url, workers)
    b = None
    try:
        wait_for(lambda: status(a)["idle_gpus"] == 3, timeout=20)
        ids = [
            httpx.post(
                a.url + "/generate", json={"lyrics": f"j{i}", "duration": 0.05, "num_tracks": 1}, verify=TLS
            ).json()["job_id"]
            for i in range(7)
        ]
        wait_for(lambda: status(a)["running_tracks"] == 3, timeout=20)
        b = start_dispatcher(tmp_path, "B", pg_url, workers)
        assert status(b)["queued_tracks"] == 4  # B sees A's queue, but every worker is leased to A (all busy)
        assert "taking over task" not in b.log_tail(1_000_000)  # A is alive: its running tracks stay its own
        a.signal(signal.SIGKILL)
        wait_for(lambda: b.log_tail(1_000_000).count("taking over task") == 3, timeout=60)  # still running
        hold.unlink()
        jobs = [wait_done(b, j, timeout=120) for j in ids]
        assert all(j["status"] == "completed" for j in jobs)
        assert all(t["attempts"] == 1 for j in jobs for t in j["tracks"])  # the 3 running ones were reattached
        assert generated(workers) == 7  # each generated once
        log_b = b.log_tail(1_000_000)
        assert log_b.count("taking over task") == 3
    finally:
        stop_all(*(p for p in (a, b) if p), *workers)


def test_an_announced_worker_gets_work_and_one_that_stops_is_retried_elsewhere(tmp_path, pg_url):
    static = tone_workers(tmp_path, 1, delay=0.5)
    a = start_dispatcher(tmp_path, "A", pg_url, static)
    joiner = None
    try:
        port = free_port()
        joiner = ServerProcess(
            [
                "backend_worker.py",
                "--worker-port",
                str(port),
                "--master-port",
                "0",
                "--pipeline",
                "test",
                "--test-delay-s",
                "30",
                "--output-dir",
                str(tmp_path / "joiner_audio"),
                "--announce",
                a.url,
                "--announce-interval-sec",
                "0.5",
            ],
            port,
            tmp_path / "joiner.log",
            env={"WORKER_TOKEN": TOKEN},
        )
        joiner.wait_healthy()
        row = wait_for(
            lambda: next((w for w in status(a)["workers"] if w["url"] == joiner.url and w["status"] == "idle"), None),
            timeout=20,
        )
        assert row["joined"] == "announced"
        # Two tracks: one on each idle worker; the announced one is slow (30 s) and is killed while busy.
        sub = httpx.post(
            a.url + "/generate", json={"lyrics": "x", "duration": 0.05, "num_tracks": 2}, verify=TLS
        ).json()
        wait_for(lambda: httpx.get(joiner.url + "/health", verify=TLS).json()["status"] == "busy", timeout=20)
        joiner.signal(signal.SIGKILL)
        wait_for(
            lambda: any(w["url"] == joiner.url and w["status"] == "offline" for w in status(a)["workers"]), timeout=20
        )
        done = wait_done(a, sub["job_id"], timeout=60)
        assert done["status"] == "completed"
        static_id = next(w["worker_id"] for w in status(a)["workers"] if w["url"] == static[0].url)
        assert [t["metadata"]["worker_id"] for t in done["tracks"]] == [static_id] * 2  # the lost one ran again there
        assert generated(static) == 2
    finally:
        stop_all(a, *(p for p in (joiner,) if p), *static)


def test_announcing_needs_the_worker_token(tmp_path, pg_url):
    a = start_dispatcher(tmp_path, "A", pg_url, [])
    try:
        body = {"url": "http://127.0.0.1:9", "ttl_sec": 5}
        r = httpx.post(a.url + "/workers", json=body, headers={"Authorization": "Bearer wrong"}, verify=TLS)
        assert r.status_code == 401
        assert "WORKER_TOKEN" in r.json()["error"]
        r = httpx.post(
            a.url + "/workers",
            json={"url": "http://x:1/path", "ttl_sec": 5},
            headers={"Authorization": f"Bearer {TOKEN}"},
            verify=TLS,
        )
        assert r.status_code == 422
        r = httpx.post(a.url + "/workers", json=body, headers={"Authorization": f"Bearer {TOKEN}"}, verify=TLS)
        assert r.status_code == 200
        wid = r.json()["worker_id"]
        wait_for(lambda: any(w["worker_id"] == wid for w in status(a)["workers"]), timeout=10)
        r = httpx.delete(f"{a.url}/workers/{wid}", headers={"Authorization": f"Bearer {TOKEN}"}, verify=TLS)
        assert r.json() == {"worker_id": wid, "left": True}
        wait_for(lambda: not status(a)["workers"], timeout=10)
        assert (
            httpx.delete(f"{a.url}/workers/{wid}", headers={"Authorization": f"Bearer {TOKEN}"}, verify=TLS).status_code
            == 404
        )
    finally:
        a.stop()


@pytest.mark.parametrize("bad", ["mysql://x/y", "postgresql://127.0.0.1:1/nowhere"])
def test_a_bad_store_url_refuses_start_up_in_one_line(tmp_path, bad):
    import subprocess
    import sys

    from tests.support.servers import ROOT

    out = subprocess.run(
        [
            sys.executable,
            "backend_api.py",
            "--port",
            str(free_port()),
            "--state-dir",
            str(tmp_path),
            "--store-url",
            bad,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    lines = [ln for ln in out.stderr.splitlines() if ln.strip() and " INFO " not in ln]
    assert len(lines) == 1, out.stderr
    assert "Traceback" not in out.stderr
    assert "store" in lines[0].lower()


def test_cancel_and_idempotency_keys_work_across_dispatchers(tmp_path, pg_url):
    workers = tone_workers(tmp_path, 2, delay=30.0)
    a = start_dispatcher(tmp_path, "A", pg_url, workers)
    b = start_dispatcher(tmp_path, "B", pg_url, workers)
    try:
        body = {"lyrics": "x", "duration": 0.05, "num_tracks": 2}
        key = {"Idempotency-Key": "same-song-1"}
        first = httpx.post(a.url + "/generate", json=body, headers=key, verify=TLS).json()
        again = httpx.post(b.url + "/generate", json=body, headers=key, verify=TLS).json()
        assert again["job_id"] == first["job_id"]  # one job, wherever the key was first used
        job_id = first["job_id"]
        wait_for(lambda: all(t["status"] == "generating" for t in job(b, job_id)["tracks"]), timeout=20)
        cancelled = httpx.delete(
            f"{b.url}/job/{job_id}", verify=TLS
        ).json()  # at B, whichever dispatcher runs the tracks
        assert cancelled["status"] == "cancelled"
        assert wait_done(a, job_id, timeout=20)["status"] == "cancelled"
        assert all(t["status"] == "cancelled" for t in wait_done(a, job_id)["tracks"])
        # The workers stopped (freed long before their 30 s), and both are idle again.
        wait_for(
            lambda: all(httpx.get(w.url + "/health", verify=TLS).json()["status"] == "idle" for w in workers),
            timeout=20,
        )
        assert generated(workers) == 0
    finally:
        stop_all(a, b, *workers)


def test_a_dispatcher_whose_database_is_gone_answers_503_and_recovers(tmp_path, pg_server, pg_url):
    """The database restarts under a running dispatcher: requests get 503 + Retry-After, then all is well."""
    workers = tone_workers(tmp_path, 1, delay=0.2)
    a = start_dispatcher(tmp_path, "A", pg_url, workers)
    try:
        done = httpx.post(
            a.url + "/generate", json={"lyrics": "x", "duration": 0.05, "num_tracks": 1}, verify=TLS
        ).json()
        wait_done(a, done["job_id"])
        pg_server.pause()
        r = httpx.post(
            a.url + "/generate", json={"lyrics": "x", "duration": 0.05, "num_tracks": 1}, timeout=30, verify=TLS
        )
        assert r.status_code == 503
        assert "Retry-After" in r.headers
        assert r.json()["status"] == "error"
        r = httpx.get(f"{a.url}/job/{'0' * 16}", timeout=30, verify=TLS)  # not in memory: needs the store
        assert r.status_code == 503
        pg_server.resume()

        def accepted():
            x = httpx.post(a.url + "/generate", json={"lyrics": "y", "duration": 0.05}, timeout=30, verify=TLS)
            return x.status_code == 200 and x

        r = wait_for(accepted, timeout=60, interval=0.5)
        assert wait_done(a, r.json()["job_id"], timeout=60)["status"] == "completed"
        assert job(a, done["job_id"])["status"] == "completed"  # what was stored before is all there
    finally:
        if not pg_server.running:
            pg_server.resume()
        stop_all(a, *workers)
