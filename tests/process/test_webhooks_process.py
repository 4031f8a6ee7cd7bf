"""Webhooks, the wait mode and keys with limits through real dispatcher processes over tone workers
(``--pipeline test``), with a real receiver on the loopback (``tests/support/receiver.py``): signed events in
order, one delivered after its dispatcher was killed -9, each event once on a PostgreSQL pair, the
wait mode's two answers, a key's 429 (both dialects) and its use across a kill -9.
"""

from __future__ import annotations

import json
import re
import signal

import httpx

from songserve.api.webhooks.sign import verify
from tests.support.http import TLS
from tests.support.pg_fleet import start_dispatcher, tone_workers
from tests.support.receiver import Receiver
from tests.support.servers import Cluster, ServerProcess, free_port, start_worker, wait_for

SECRET = "whsec_c29uZ3NlcnZlLXdlYmhvb2stdGVzdC1zZWNyZXQ="
HOOKS = ("--webhook-secret", SECRET, "--webhook-allow", "127.0.0.1/32", "--webhook-retry-base-sec", "0.2")
BODY = {"lyrics": "hello\nworld", "tags": "pop", "duration": 0.05, "num_tracks": 1}


def metric(api: ServerProcess, name: str) -> float:
    text = httpx.get(api.url + "/metrics", timeout=10, verify=TLS).text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_real_jobs_events_arrive_signed_in_order_and_survive_a_kill_9_before_delivery(tmp_path):
    with Receiver() as rx, Cluster(tmp_path, workers=1, delay=0.3, api_args=HOOKS) as c:
        kinds = ["start", "track", "completed"]
        first = c.submit(webhook=rx.url, webhook_events=kinds, num_tracks=2)["job_id"]
        wait_for(lambda: rx.events("completed"), timeout=60)
        hits = rx.events()
        assert [h.event["type"] for h in hits] == ["start", "track", "track", "completed"]
        for h in hits:
            assert h.event["data"]["job_id"] == first
            assert verify(SECRET, h.headers, h.body)
            assert not verify("whsec_" + "QUJD" * 8, h.headers, h.body)
        assert hits[-1].event["data"]["tracks"][1]["files"]["mp3"] == f"/job/{first}/track/1/mp3"

        # The receiver is down: the next job completes, its event waits in the outbox, the dispatcher dies.
        rx.default = 503
        second = c.submit(webhook=rx.url)["job_id"]
        c.wait_job(second)
        wait_for(lambda: [h for h in rx.events() if h.event["data"]["job_id"] == second], timeout=30)
        wait_for(lambda: metric(c.api, "songserve_webhook_outbox_depth") == 1, timeout=10)
        c.api.signal(signal.SIGKILL)
        c.api.proc.wait(10)
        failed = {h.id for h in rx.events() if h.event["data"]["job_id"] == second}
        tried = len(rx.hits)
        rx.default = 200
        c.start_api()  # the same store, the same dispatcher id: it delivers what its predecessor could not
        wait_for(lambda: metric(c.api, 'songserve_webhook_deliveries_total{event="completed"}') == 1, timeout=60)
        after = rx.hits[tried:]
        assert {h.id for h in after} == failed  # the same event, the same id, delivered once after the restart
        assert len(after) == 1
        assert after[0].event["data"]["status"] == "completed"
        assert verify(SECRET, after[0].headers, after[0].body)


def test_each_event_is_delivered_once_by_a_postgresql_pair(tmp_path, pg_url):
    workers = tone_workers(tmp_path, 2, 0.2)
    apis = [start_dispatcher(tmp_path, name, pg_url, workers, *HOOKS) for name in ("A", "B")]
    try:
        with Receiver() as rx:
            kinds = ["start", "track", "completed"]
            jobs = []
            for i in range(6):
                r = httpx.post(
                    apis[i % 2].url + "/generate",
                    json={**BODY, "num_tracks": 2, "webhook": rx.url, "webhook_events": kinds},
                    timeout=10,
                    verify=TLS,
                )
                assert r.status_code == 200, r.text
                jobs.append(r.json()["job_id"])
            wait_for(lambda: len(rx.events("completed")) == len(jobs), timeout=120)
            wait_for(lambda: all(metric(a, "songserve_webhook_outbox_depth") == 0 for a in apis), timeout=30)
            hits = rx.events()
            ids = [h.id for h in hits]
            assert len(ids) == len(set(ids)) == 4 * len(jobs)  # each of the 24 events once
            for job_id in jobs:
                mine = [h.event["type"] for h in hits if h.event["data"]["job_id"] == job_id]
                assert mine == ["start", "track", "track", "completed"], (job_id, mine)
            by_dispatcher = [metric(a, 'songserve_webhook_deliveries_total{event="completed"}') for a in apis]
            assert sum(by_dispatcher) == len(jobs)
    finally:
        for p in [*apis, *workers]:
            p.stop()


def test_wait_mode_keys_with_limits_and_usage_across_a_kill_9(tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"k-studio": {"name": "studio", "tracks_per_hour": 2}, "k-other": {"name": "other"}}))
    worker = start_worker(tmp_path, "--pipeline", "test", "--test-delay-s", "1.5")
    worker.wait_healthy()
    port, ace = free_port(), free_port()
    args = [
        "backend_api.py",
        "--port",
        str(port),
        "--state-dir",
        str(tmp_path / "state"),
        "--worker-urls",
        worker.url,
        "--health-interval",
        "0.2",
        "--api-keys-file",
        str(keys),
        "--acestep-port",
        str(ace),
        "--webhook-secret",
        SECRET,
    ]
    studio, other = {"Authorization": "Bearer k-studio"}, {"Authorization": "Bearer k-other"}

    def start() -> ServerProcess:
        api = ServerProcess(args, port, tmp_path / "api.log")
        api.wait_healthy(want=("ok",))
        wait_for(lambda: httpx.get(api.url + "/status", headers=other, verify=TLS).json()["idle_gpus"] == 1, timeout=30)
        return api

    api = start()
    try:
        url = api.url + "/generate"
        assert httpx.post(url, json=BODY, timeout=10, verify=TLS).status_code == 401
        # a private-range webhook: refused before any work, naming the field (no WEBHOOK_ALLOW here)
        r = httpx.post(url, json={**BODY, "webhook": "http://127.0.0.1:9/hook"}, headers=other, timeout=10, verify=TLS)
        assert r.status_code == 422
        assert r.json()["detail"][0]["loc"] == ["body", "webhook"]
        assert "loopback" in r.json()["error"]
        # the wait mode: the job ends within the wait (its view, 200), or not (today's answer, 202)
        r = httpx.post(url, json=BODY, headers={**studio, "Prefer": "wait=30"}, timeout=60, verify=TLS)
        assert r.status_code == 200, r.text
        assert r.headers["preference-applied"] == "wait=30"
        assert r.json()["status"] == "completed"
        assert r.json()["tracks"][0]["files"]["mp3"].endswith("/track/0/mp3")
        r = httpx.post(url, json=BODY, headers={**studio, "Prefer": "wait=1"}, timeout=60, verify=TLS)
        assert r.status_code == 202, r.text
        assert r.headers["preference-applied"] == "wait=1"
        assert r.json()["status"] in ("accepted", "queued")
        assert r.json()["job_id"]
        # the third track of the hour: 429 naming the limit; another key is not counted with it
        r = httpx.post(url, json=BODY, headers=studio, timeout=10, verify=TLS)
        assert r.status_code == 429, r.text
        assert 3000 < int(r.headers["retry-after"]) <= 3600
        assert r.json()["limit"] == {"name": "tracks_per_hour", "value": 2, "used": 2}
        assert "tracks_per_hour" in r.json()["error"]
        assert httpx.post(url, json=BODY, headers=other, timeout=10, verify=TLS).status_code == 200
        r = httpx.post(
            f"http://127.0.0.1:{ace}/release_task", json={"caption": "pop", "ai_token": "k-studio"}, verify=TLS
        )
        assert r.status_code == 429
        assert r.json()["code"] == 429
        assert "tracks_per_hour" in r.json()["error"]
        use = httpx.get(api.url + "/usage", headers=studio, timeout=10, verify=TLS).json()
        assert (use["name"], use["tracks_last_hour"], use["tracks_left"]) == ("studio", 2, 0)
        assert "k-studio" not in api.log_tail(10**7)  # keys are never logged; names are
        assert "key studio" in api.log_tail(10**7)

        api.signal(signal.SIGKILL)
        api.proc.wait(10)
        api.stop()
        api = start()
        use = httpx.get(api.url + "/usage", headers=studio, timeout=10, verify=TLS).json()
        assert (use["tracks_last_hour"], use["tracks_left"], use["limits"]["tracks_per_hour"]) == (2, 0, 2)
        assert httpx.post(api.url + "/generate", json=BODY, headers=studio, timeout=10, verify=TLS).status_code == 429
        other_use = httpx.get(api.url + "/usage", headers=other, timeout=10, verify=TLS).json()
        assert (other_use["tracks_last_hour"], other_use["tracks_left"]) == (1, None)
    finally:
        api.stop()
        worker.stop()
