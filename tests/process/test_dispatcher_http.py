"""The dispatcher against real worker processes over real HTTP."""

from __future__ import annotations

import io
import re
import signal

import httpx
import pytest
import soundfile as sf

from tests.support.http import TLS
from tests.support.servers import Cluster, wait_for
from tests.support.tiny_site import tiny_site

KHALA_BODY = {
    "mode": "vocal",
    "prompt_mode": "tags",
    "prompt": "",
    "tags": "pop, piano",
    "lyrics": "[verse]\n月光洒在窗前。\nhello world",
    "duration": 0.05,
    "top_k_bb": 80,
    "temperature": 1.0,
}
JOB_FIELDS = {
    "job_id",
    "status",
    "queue_position",
    "cleaned_lyrics",
    "created_at",
    "started_at",
    "finished_at",
    "eta_sec",
    "tracks",
}
TRACK_FIELDS = {
    "index",
    "status",
    "progress",
    "phase_display",
    "worker_id",
    "worker_phase",
    "duration_sec",
    "error",
    "seed",
    "files",
    "metadata",
}


@pytest.fixture
def two(tmp_path):
    c = Cluster(tmp_path, workers=2, delay=1.5, threads=True)
    yield c
    c.stop()


def one_worker(tmp_path, threads: bool = True) -> Cluster:
    # Track by track (no packing into batches): these tests are about the order of single tracks.
    return Cluster(tmp_path, workers=1, delay=1.0, api_args=("--pack-tracks", "never"), threads=threads)


@pytest.fixture
def one(tmp_path):
    with one_worker(tmp_path) as c:
        yield c


@pytest.fixture
def one_logged(tmp_path):
    """Processes: the test reads their log files."""
    with one_worker(tmp_path, threads=False) as c:
        yield c


def running(job: dict) -> list[int]:
    return [t["index"] for t in job["tracks"] if t["status"] in ("generating", "superres", "decoding")]


def test_khala_body_two_tracks_in_parallel_files_match_worker(two):
    r = httpx.post(two.url + "/generate", json=KHALA_BODY, verify=TLS)
    assert r.status_code == 200
    acc = r.json()
    assert acc["num_tracks"] == 2
    assert acc["status"] == "accepted"
    assert acc["queue_position"] == 0
    job_id = acc["job_id"]
    first = two.job(job_id)
    assert JOB_FIELDS <= set(first)
    assert len(first["tracks"]) == 2
    assert all(TRACK_FIELDS <= set(t) for t in first["tracks"])
    wait_for(lambda: len(running(two.job(job_id))) == 2, timeout=10)  # both at once
    job = two.wait_job(job_id)
    assert job["status"] == "completed"
    assert job["cleaned_lyrics"] == "[verse]\n月光洒在窗前.\nhello world"
    assert {t["worker_id"] for t in job["tracks"]} == {0, 1}
    for t in job["tracks"]:
        assert t["status"] == "done"
        assert t["progress"] == 100
        assert t["phase_display"] == "Done"
        assert t["files"] == {
            "mp3": f"/job/{job_id}/track/{t['index']}/mp3",
            "wav": f"/job/{job_id}/track/{t['index']}/wav",
            "codes": f"/job/{job_id}/track/{t['index']}/codes",  # ours: the take's code grid
        }
        for kind in ("wav", "mp3", "codes"):
            ours = httpx.get(f"{two.url}/job/{job_id}/track/{t['index']}/{kind}", verify=TLS)
            assert ours.status_code == 200
            assert len(ours.content) == t["metadata"]["file_bytes"][kind]  # as copied from the worker
            assert ours.headers["content-length"] == str(len(ours.content))
    # The worker's own copies are removed once collected (DELETE /files/{task_id}).
    for w in two.workers:
        wait_for(lambda w=w: httpx.get(w.url + "/health", verify=TLS).json()["output_files"] == 0, timeout=10)
    wav = httpx.get(f"{two.url}/job/{job_id}/track/1/wav", verify=TLS)
    assert wav.headers["content-type"] == "audio/wav"
    assert "attachment" in wav.headers["content-disposition"]
    mp3 = httpx.get(f"{two.url}/job/{job_id}/track/0/mp3", verify=TLS)
    assert mp3.headers["content-type"] == "audio/mpeg"
    assert "inline" in mp3.headers["content-disposition"]
    assert sf.info(io.BytesIO(mp3.content)).channels == 2
    part = httpx.get(f"{two.url}/job/{job_id}/track/0/mp3", headers={"Range": "bytes=100-1099"}, verify=TLS)
    assert part.status_code == 206
    assert part.content == mp3.content[100:1100]
    assert part.headers["content-range"] == f"bytes 100-1099/{len(mp3.content)}"


def test_one_worker_runs_tracks_one_after_another_and_later_job_queues(one_logged):
    one = one_logged
    a = one.submit(num_tracks=2)
    b = one.submit(num_tracks=1)
    assert b["status"] == "queued"
    assert b["queue_position"] >= 1

    def both_done() -> bool:
        ja, jb = one.job(a["job_id"]), one.job(b["job_id"])
        if jb["status"] == "queued":
            assert jb["queue_position"] >= 1
            assert jb["tracks"][0]["phase_display"].startswith("Queued · Position #")
        return ja["status"] == "completed" and jb["status"] == "completed"

    wait_for(both_done, timeout=30, interval=0.1)
    # The worker's own log: each task ends before the next starts, and nothing was sent while busy.
    events = re.findall(r"task (\S+): (start|done)", one.workers[0].log_tail(100_000))
    assert [kind for _, kind in events] == ["start", "done"] * 3
    assert all(events[i][0] == events[i + 1][0] for i in range(0, 6, 2))
    assert "was busy" not in (one.tmp / "api.log").read_text()
    # With finished tracks on record, a new job gets an estimate from their measured speed.
    c = one.submit(num_tracks=1)
    eta = one.job(c["job_id"])["eta_sec"]
    assert isinstance(eta, float)
    assert eta > 0
    one.wait_job(c["job_id"])
    ja, jb = one.job(a["job_id"]), one.job(b["job_id"])
    assert ja["status"] == jb["status"] == "completed"
    assert all(t["attempts"] == 1 for t in ja["tracks"] + jb["tracks"])


def test_fairness_later_single_track_job_is_not_starved(one):
    a = one.submit(num_tracks=4)
    b = one.submit(num_tracks=1)
    jb = one.wait_job(b["job_id"], timeout=60)
    ja = one.job(a["job_id"])
    done_a = sum(t["status"] == "done" for t in ja["tracks"])
    assert jb["status"] == "completed"
    assert done_a <= 2
    httpx.delete(f"{one.url}/job/{a['job_id']}", verify=TLS)  # its other tracks prove nothing more
    one.wait_job(a["job_id"], timeout=60)


def test_cancel_queued_and_running(one):
    a = one.submit(num_tracks=1, duration=0.2)
    b = one.submit(num_tracks=2)
    wait_for(lambda: running(one.job(a["job_id"])), timeout=10)
    cb = httpx.delete(f"{one.url}/job/{b['job_id']}", verify=TLS).json()
    assert cb["status"] == "cancelled"
    assert all(t["status"] == "cancelled" for t in cb["tracks"])
    httpx.delete(f"{one.url}/job/{a['job_id']}", verify=TLS)
    assert one.job(a["job_id"])["status"] == "cancelled"
    ja = wait_for(lambda: (j := one.job(a["job_id"]))["tracks"][0]["status"] == "cancelled" and j, timeout=10)
    assert ja["status"] == "cancelled"
    wait_for(lambda: httpx.get(one.url + "/status", verify=TLS).json()["idle_gpus"] == 1, timeout=5)
    c = one.submit(num_tracks=1)
    assert one.wait_job(c["job_id"])["status"] == "completed"
    assert (
        httpx.delete(f"{one.url}/job/{c['job_id']}", verify=TLS).json()["status"] == "completed"
    )  # no-op when finished


@pytest.mark.process
def test_restart_loses_nothing(tmp_path):
    # The running track waits on the hold file (TEST_HOLD_FILE) until the dispatcher is dead, instead of
    # a delay long enough for a loaded machine that every queued track then paid as well.
    hold = tmp_path / "hold"
    flags = ("--pipeline", "test", "--test-delay-s", "0.2", "--test-hold-file", str(hold))
    with Cluster(tmp_path, workers=1, worker_args=flags) as c:
        done = c.submit(num_tracks=1)
        c.wait_job(done["job_id"])
        before = httpx.get(f"{c.url}/job/{done['job_id']}/track/0/wav", verify=TLS).content
        hold.touch()
        running_job = c.submit(num_tracks=1)
        queued = [c.submit(num_tracks=2) for _ in range(2)]
        wait_for(lambda: running(c.job(running_job["job_id"])), timeout=10)
        c.api.signal(signal.SIGKILL)
        c.api.proc.wait(10)
        hold.unlink()
        # The running track finishes on the worker while no dispatcher is up.
        wait_for(lambda: httpx.get(c.workers[0].url + "/health", verify=TLS).json()["tasks_done"] == 2, timeout=30)
        c.start_api()
        jobs = [c.wait_job(j["job_id"], timeout=60) for j in [running_job, *queued]]
        assert all(j["status"] == "completed" for j in jobs)
        assert jobs[0]["tracks"][0]["attempts"] == 1  # collected from the worker, not generated again
        assert httpx.get(f"{c.url}/job/{done['job_id']}/track/0/wav", verify=TLS).content == before


def test_queue_full_429_and_validation_422(tmp_path):
    with Cluster(tmp_path, workers=1, delay=3.0, api_args=("--max-queue", "3"), threads=True) as c:
        c.submit(num_tracks=1)
        wait_for(lambda: httpx.get(c.url + "/status", verify=TLS).json()["running_tracks"] == 1, timeout=10)
        c.submit(num_tracks=3)
        r = httpx.post(c.url + "/generate", json={"lyrics": "x", "num_tracks": 1}, verify=TLS)
        assert r.status_code == 429
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["status"] == "error"
        assert "queue is full" in r.json()["error"]
        for body, field in [
            ({"lyrics": "x", "duration": "long"}, "duration"),  # out of range is clamped; not a number is 422
            ({"lyrics": "x", "top_k_bb": 80.5}, "top_k_bb"),
            ({"lyrics": "x", "temperature": [1]}, "temperature"),
            ({"lyrics": 7}, "lyrics"),
            ({"lyrics": "x", "mode": None}, "mode"),
            ({"lyrics": "x", "priority": 10}, "priority"),
        ]:
            r = httpx.post(c.url + "/generate", json=body, verify=TLS)
            assert r.status_code == 422, body
            e = r.json()
            assert e["status"] == "error"
            assert field in e["error"]
            assert e["detail"][0]["loc"][-1] == field
        assert httpx.get(c.url + "/job/nope", verify=TLS).json() == {"status": "error", "error": "Job nope not found."}
        assert httpx.get(c.url + "/job/abcdef0123456789/track/0/mp3", verify=TLS).status_code == 404


def test_track_file_errors_and_idempotency(one):
    a = one.submit(num_tracks=1)
    r = httpx.get(f"{one.url}/job/{a['job_id']}/track/5/mp3", verify=TLS)
    assert r.status_code == 400
    assert r.json()["status"] == "error"
    r = httpx.get(f"{one.url}/job/{a['job_id']}/track/0/mp3", verify=TLS)
    assert r.status_code == 404
    assert "not done" in r.json()["error"]
    h = {"Idempotency-Key": "k-1"}
    x = httpx.post(one.url + "/generate", json={"lyrics": "x", "num_tracks": 1}, headers=h, verify=TLS).json()
    y = httpx.post(one.url + "/generate", json={"lyrics": "x", "num_tracks": 1}, headers=h, verify=TLS).json()
    assert x["job_id"] == y["job_id"]


def test_events_stream_ends_at_a_terminal_state(one):
    a = one.submit(num_tracks=1)
    statuses = []
    with httpx.stream("GET", f"{one.url}/job/{a['job_id']}/events", timeout=30, verify=TLS) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                import json

                statuses.append(json.loads(line[6:])["status"])
    assert statuses[-1] == "completed"
    assert len(statuses) >= 2


def test_status_tags_metrics_config_docs(one):
    st = httpx.get(one.url + "/status", verify=TLS).json()
    assert {"total_gpus", "idle_gpus", "active_jobs", "queued_jobs", "workers"} <= set(st)
    assert st["workers"][0]["status"] == "idle"
    assert {"worker_id", "url", "phase", "gpu_id"} <= set(st["workers"][0])
    tags = httpx.get(one.url + "/tags", verify=TLS).json()
    assert set(tags) == {"genre_style", "vocal_instrument", "emotion_mood", "production_other"}
    assert all(v["label"] and v["tags"] for v in tags.values())
    m = httpx.get(one.url + "/metrics", verify=TLS).text
    assert "songserve_queue_length 0.0" in m
    assert 'songserve_worker_state{state="idle",worker="0"} 1.0' in m
    assert httpx.get(one.url + "/config", verify=TLS).json()["backbone_models"] == ["default_backbone"]
    assert httpx.get(one.url + "/ready", verify=TLS).status_code == 200
    docs = httpx.get(one.url + "/docs", verify=TLS)
    assert docs.status_code == 200
    assert "cdn." not in docs.text  # Swagger UI from the dispatcher itself (http/api_docs.py): works offline
    for asset in ("docs/assets/swagger-ui-bundle.js", "docs/assets/swagger-ui.css"):
        assert f'"{asset}"' in docs.text
        assert len(httpx.get(f"{one.url}/{asset}", verify=TLS).content) > 100_000
    assert httpx.get(one.url + "/docs/assets/..%2Fcore.py", verify=TLS).status_code == 404  # named files only
    redoc = httpx.get(one.url + "/redoc", verify=TLS)
    assert '"docs/assets/redoc.standalone.js"' in redoc.text
    assert "googleapis" not in redoc.text
    assert httpx.get(one.url + "/openapi.json", verify=TLS).json()["paths"]["/generate"]


def test_tiny_model_worker_through_the_dispatcher(tmp_path, shared_tiny):
    with tiny_site(shared_tiny, tmp_path) as c:
        a = c.submit(num_tracks=2, duration=0.05, seed=42)
        job = c.wait_job(a["job_id"], timeout=120)
        assert job["status"] == "completed"
        assert [t["seed"] for t in job["tracks"]] == [42, 43]
        wav = httpx.get(f"{c.url}/job/{a['job_id']}/track/1/wav", verify=TLS).content
        data, sr = sf.read(io.BytesIO(wav))
        assert sr == 44100
        assert data.shape[1] == 2
        assert abs(data.shape[0] / sr - 3.0) < 0.1
        assert job["tracks"][0]["metadata"]["timings"]["backbone_sec"] > 0
        # one idle worker, two tracks: packed into one batch, and the view says so
        assert [t["metadata"]["batch_size"] for t in job["tracks"]] == [2, 2]


def test_a_four_track_job_is_packed_onto_the_one_idle_worker_and_spread_over_four(tmp_path):
    tone = ("--pipeline", "test", "--test-delay-s", "0.5", "--max-batch", "4")
    (tmp_path / "one").mkdir()
    (tmp_path / "four").mkdir()
    # Servers in threads: each take's batch_size is the length of the batch its worker's pipeline was
    # handed (the tone pipeline's run_batch), the fact the workers' logs say as "batch of N".
    with Cluster(tmp_path / "one", workers=1, worker_args=tone, threads=True) as c:
        job = c.wait_job(c.submit(num_tracks=4)["job_id"], timeout=60)
        assert job["status"] == "completed"
        assert [t["metadata"]["batch_size"] for t in job["tracks"]] == [4, 4, 4, 4]
    with Cluster(tmp_path / "four", workers=4, worker_args=tone, threads=True) as c:
        job = c.wait_job(c.submit(num_tracks=4)["job_id"], timeout=60)
        assert job["status"] == "completed"
        assert {t["metadata"]["worker_id"] for t in job["tracks"]} == {0, 1, 2, 3}
        assert [t["metadata"]["batch_size"] for t in job["tracks"]] == [1, 1, 1, 1]


def test_the_dispatchers_config_counts_workers_that_say_they_run_an_untrained_set(tmp_path):
    args = ("--pipeline", "test", "--test-untrained", "true")
    with Cluster(tmp_path, workers=1, worker_args=args, threads=True) as c:
        assert httpx.get(c.workers[0].url + "/config", verify=TLS).json()["untrained"] is True
        # read when the worker comes online, in the poll that saw it idle: wait for it, not for /status
        config = wait_for(
            lambda: (got := httpx.get(c.url + "/config", verify=TLS).json())["untrained_workers"] == 1 and got
        )
        assert config["notice"].startswith("Tiny test model: the audio is noise of the right length.")
