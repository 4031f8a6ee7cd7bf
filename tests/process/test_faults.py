"""Fault injection through real processes: no job lost, no worker stuck."""

from __future__ import annotations

import concurrent.futures as cf
import random
import signal
import time

import httpx

from tests.support.http import TLS
from tests.support.servers import Cluster, ServerProcess, start_worker, wait_for

TERMINAL = {"completed", "partial", "failed", "cancelled"}


def in_phase(c: Cluster, job_id: str, phase: str) -> dict | None:
    job = c.job(job_id)
    return next((t for t in job["tracks"] if t["worker_phase"] == phase), None)


def test_worker_killed_in_backbone_track_finishes_on_the_other(tmp_path):
    with Cluster(tmp_path, workers=2, delay=4.0) as c:
        a = c.submit(num_tracks=1)
        t = wait_for(lambda: in_phase(c, a["job_id"], "backbone"), timeout=10)
        victim = c.workers[t["worker_id"]]
        victim.signal(signal.SIGKILL)
        job = c.wait_job(a["job_id"], timeout=60)
        assert job["status"] == "completed"
        track = job["tracks"][0]
        assert track["attempts"] == 2
        assert track["worker_id"] != t["worker_id"]
        assert httpx.get(f"{c.url}/job/{a['job_id']}/track/0/mp3", verify=TLS).status_code == 200
        st = httpx.get(c.url + "/status", verify=TLS).json()
        assert st["workers"][t["worker_id"]]["status"] == "offline"


def test_only_worker_killed_then_restarted_track_completes(tmp_path):
    with Cluster(tmp_path, workers=1, delay=3.0) as c:
        a = c.submit(num_tracks=1)
        wait_for(lambda: in_phase(c, a["job_id"], "backbone"), timeout=10)
        port = c.workers[0].port
        c.workers[0].signal(signal.SIGKILL)
        c.workers[0].proc.wait(10)
        c.workers[0].stop()  # closes its log
        # Waiting for a worker, not stuck running.
        wait_for(lambda: c.job(a["job_id"])["status"] in ("queued", "pending"), timeout=30)
        # The same port as before, so the dispatcher's worker 0 comes back.
        w = ServerProcess(
            [
                "backend_worker.py",
                "--worker-port",
                str(port),
                "--pipeline",
                "test",
                "--test-delay-s",
                "1",
                "--output-dir",
                str(tmp_path / "again"),
            ],
            port,
            tmp_path / "again.log",
        )
        c.workers[0] = w
        job = c.wait_job(a["job_id"], timeout=60)
        assert job["status"] == "completed"
        assert job["tracks"][0]["attempts"] == 2


def test_attempts_run_out_with_a_clear_error(tmp_path):
    with Cluster(tmp_path, workers=1, delay=3.0, api_args=("--max-attempts", "1")) as c:
        a = c.submit(num_tracks=1)
        wait_for(lambda: in_phase(c, a["job_id"], "backbone"), timeout=10)
        c.workers[0].signal(signal.SIGKILL)
        job = c.wait_job(a["job_id"], timeout=30)
        assert job["status"] == "failed"
        err = job["tracks"][0]["error"]
        assert err.startswith("Track failed after 1 attempts: worker 0")
        assert "Traceback" not in err


def test_dispatcher_killed_with_20_queued_and_2_running(tmp_path):
    # The two first tracks wait on the hold file (TEST_HOLD_FILE) until the dispatcher is dead, instead
    # of a delay long enough for the submissions on a loaded machine (2 s a track, 22 s a test).
    hold = tmp_path / "hold"
    hold.touch()
    flags = ("--pipeline", "test", "--test-delay-s", "0.2", "--test-hold-file", str(hold))
    with Cluster(tmp_path, workers=2, worker_args=flags, api_args=("--max-queue", "50")) as c:
        jobs = [c.submit(num_tracks=1) for _ in range(2)]
        wait_for(lambda: httpx.get(c.url + "/status", verify=TLS).json()["running_tracks"] == 2, timeout=10)
        jobs += [c.submit(num_tracks=2) for _ in range(10)]
        assert httpx.get(c.url + "/status", verify=TLS).json()["queued_tracks"] == 20
        c.api.signal(signal.SIGKILL)
        c.api.proc.wait(10)
        hold.unlink()
        # The two running tracks finish on their workers while no dispatcher is up.
        for w in c.workers:
            wait_for(lambda w=w: httpx.get(w.url + "/health", verify=TLS).json()["tasks_done"] == 1, timeout=30)
        c.start_api()
        done = [c.wait_job(j["job_id"], timeout=120) for j in jobs]
        assert all(j["status"] == "completed" for j in done)
        assert [j["tracks"][0]["attempts"] for j in done[:2]] == [1, 1]  # collected, not generated again
        for j in done:
            for t in j["tracks"]:
                assert httpx.head(f"{c.url}/job/{j['job_id']}/track/{t['index']}/wav", verify=TLS).status_code == 200


def test_hung_model_thread_is_reported_stalled_and_the_track_moves(tmp_path):
    hung = start_worker(tmp_path, "--pipeline", "test", "--test-hang", "true", "--stall-timeout-sec", "1", name="hung")
    good = start_worker(tmp_path, "--pipeline", "test", "--test-delay-s", "0.5", name="good")
    for w in (hung, good):
        w.wait_healthy()
    c = Cluster.__new__(Cluster)
    c.tmp, c.api_args, c.workers, c.api = tmp_path, ("--stall-timeout-sec", "30"), [hung, good], None
    try:
        c.start_api()
        # Occupy the good worker first so the hung one gets the next track.
        first = c.submit(num_tracks=1, duration=0.1)
        second = c.submit(num_tracks=1)
        wait_for(lambda: httpx.get(hung.url + "/health", verify=TLS).json()["status"] == "stalled", timeout=20)
        ready = httpx.get(hung.url + "/ready", verify=TLS)  # alive (health answers) but not ready
        assert ready.status_code == 503
        assert ready.json()["status"] == "error"
        job = c.wait_job(second["job_id"], timeout=60)
        assert job["status"] == "completed"
        assert c.wait_job(first["job_id"])["status"] == "completed"
        st = httpx.get(c.url + "/status", verify=TLS).json()
        assert st["workers"][0]["status"] == "stalled"
        assert any(t["attempts"] == 2 for j in (c.job(first["job_id"]), job) for t in j["tracks"])
    finally:
        # Its model thread never ends, so SIGTERM's drain would outlast stop()'s 10 s before its SIGKILL.
        hung.signal(signal.SIGKILL)
        c.stop()


def test_200_tracks_from_20_clients_on_4_workers_none_lost_none_twice(tmp_path):
    """One dispatcher under load (500 tracks over two dispatchers: test_scaleout)."""
    # The schedule is the point; 0.2 s a take bounds the four workers at ~20 tracks/s, so twenty clients
    # sending back to back fill the queue of 20 whatever the machine's speed (with takes of 0 s, a loaded
    # machine could drain it as fast as they sent, and no 429 came).
    tiny_tones = (
        "--pipeline",
        "test",
        "--test-delay-s",
        "0.2",
        "--test-max-audio-sec",
        "0.1",
    )
    with Cluster(tmp_path, workers=4, api_args=("--max-queue", "20"), worker_args=tiny_tones) as c:
        rng = random.Random(0)
        accepted: list[str] = []
        rejections = {"429": 0, "retry_after_missing": 0}

        def client(n: int) -> list[str]:
            ids, submitted = [], 0
            with httpx.Client(base_url=c.url, timeout=30, verify=TLS) as http:
                while submitted < 10:
                    r = http.post("/generate", json={"lyrics": f"client {n}", "duration": 0.05, "num_tracks": 1})
                    if r.status_code == 429:
                        rejections["429"] += 1
                        if "retry-after" not in r.headers:
                            rejections["retry_after_missing"] += 1
                        time.sleep(min(float(r.headers.get("retry-after", 1)), 0.5) * rng.random() + 0.05)
                        continue
                    assert r.status_code == 200, r.text
                    ids.append(r.json()["job_id"])
                    submitted += 1
            return ids

        with cf.ThreadPoolExecutor(20) as pool:
            for ids in pool.map(client, range(20)):
                accepted += ids
        assert len(accepted) == 200 == len(set(accepted))
        jobs = [c.wait_job(j, timeout=300) for j in accepted]
        assert all(j["status"] == "completed" for j in jobs)
        assert rejections["429"] > 0
        assert rejections["retry_after_missing"] == 0
        # 0 duplicated results: one result per track, each collected once, from one task.
        assert all(t["attempts"] == 1 for j in jobs for t in j["tracks"])
        files = list((tmp_path / "state" / "results").glob("*/track_0.wav"))
        assert len(files) == 200
        # Workers delete collected files: count the tasks each one finished in its log instead.
        produced = sum(w.log_tail(10_000_000).count(": done in ") for w in c.workers)
        assert produced == 200


def test_sigterm_drains_the_dispatcher(tmp_path):
    # The running track waits on the hold file (TEST_HOLD_FILE) until the draining dispatcher has been
    # seen refusing new work, instead of a delay long enough for a loaded machine.
    hold = tmp_path / "hold"
    hold.touch()
    flags = ("--pipeline", "test", "--test-delay-s", "0.2", "--test-hold-file", str(hold))
    with Cluster(tmp_path, workers=1, worker_args=flags, api_args=("--drain-timeout-sec", "20")) as c:
        a = c.submit(num_tracks=1)
        queued = c.submit(num_tracks=1)
        wait_for(lambda: httpx.get(c.url + "/status", verify=TLS).json()["running_tracks"] == 1, timeout=10)
        c.api.signal(signal.SIGTERM)
        r = wait_for(
            lambda: (x := httpx.post(c.url + "/generate", json={"lyrics": "x"}, verify=TLS)).status_code == 503 and x,
            timeout=5,
        )
        assert r.json()["status"] == "error"
        assert "shutting down" in r.json()["error"]
        hold.unlink()
        assert c.api.proc.wait(30) == 0
        c.start_api()
        assert c.wait_job(a["job_id"])["tracks"][0]["attempts"] == 1  # finished during the drain
        assert c.wait_job(queued["job_id"], timeout=30)["status"] == "completed"  # the queue was kept


def test_a_drain_time_of_0_stops_the_dispatcher_without_waiting_for_its_running_track(tmp_path):
    # DRAIN_TIMEOUT_SEC=0 once meant "wait without end": a held track kept the dispatcher up.
    hold = tmp_path / "hold"
    hold.touch()
    flags = ("--pipeline", "test", "--test-delay-s", "0.2", "--test-hold-file", str(hold))
    with Cluster(tmp_path, workers=1, worker_args=flags, api_args=("--drain-timeout-sec", "0")) as c:
        job = c.submit(num_tracks=1)
        wait_for(lambda: httpx.get(c.url + "/status", verify=TLS).json()["running_tracks"] == 1, timeout=10)
        c.api.signal(signal.SIGTERM)
        assert c.api.proc.wait(10) == 0  # the track is held: only a drain that waits for none ends
        assert "1 track still running is picked up again at the next start" in c.api.log_tail()
        hold.unlink()
        c.start_api()
        assert c.wait_job(job["job_id"], timeout=30)["tracks"][0]["attempts"] == 1  # collected, not made again


def test_sigterm_on_a_busy_worker_cancels_within_its_drain_time(tmp_path):
    w = start_worker(tmp_path, "--pipeline", "test", "--test-delay-s", "30", "--drain-timeout-sec", "1")
    w.wait_healthy()
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(httpx.post, w.url + "/generate", json={"duration": 0.05, "task_id": "long"}, timeout=30)
        wait_for(lambda: httpx.get(w.url + "/health", verify=TLS).json()["status"] == "busy", timeout=10)
        w.signal(signal.SIGTERM)
        # Cancelled after its 1 s drain time, long before the task's 30 s: reported to its caller.
        assert fut.result(timeout=15).json()["status"] == "cancelled"
    assert w.proc.wait(15) == 0
    w.stop()
