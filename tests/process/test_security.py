"""Security and robustness through real processes: auth, tokens, limits, traversal, fuzzing."""

from __future__ import annotations

import os

import httpx
import pytest

from tests.support.http import TLS
from tests.support.servers import Cluster, ServerProcess, free_port, start_worker

KEY = "test-api-key-123"
TOKEN = "worker-token-456"


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    """A dispatcher with an API key, and a worker that needs the shared token."""
    tmp = tmp_path_factory.mktemp("secured")
    os.environ["WORKER_TOKEN"] = TOKEN  # both processes read it from the environment
    try:
        c = Cluster.__new__(Cluster)
        c.tmp, c.workers, c.api = tmp, [start_worker(tmp, "--pipeline", "test")], None
        c.workers[0].wait_healthy()
        port = free_port()
        c.api = ServerProcess(
            [
                "backend_api.py",
                "--port",
                str(port),
                "--state-dir",
                str(tmp / "state"),
                "--worker-urls",
                c.workers[0].url,
                "--health-interval",
                "0.2",
                "--api-key",
                KEY,
            ],
            port,
            tmp / "api.log",
        )
        c.api.wait_healthy(want=("ok",))
    finally:
        del os.environ["WORKER_TOKEN"]
    yield c
    c.stop()


def auth(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_api_key_guards_every_route_but_health_and_page(secured):
    url = secured.url
    job = httpx.post(
        url + "/generate", json={"lyrics": "x", "duration": 0.05, "num_tracks": 1}, headers=auth(), verify=TLS
    )
    assert job.status_code == 200
    job_id = job.json()["job_id"]
    guarded = [
        ("POST", "/generate"),
        ("GET", f"/job/{job_id}"),
        ("DELETE", f"/job/{job_id}"),
        ("GET", f"/job/{job_id}/events"),
        ("GET", f"/job/{job_id}/track/0/mp3"),
        ("GET", "/status"),
        ("GET", "/config"),
        ("GET", "/metrics"),
        ("GET", "/docs"),
        ("GET", "/openapi.json"),
    ]
    for method, path in guarded:
        for headers in ({}, auth("wrong"), {"Authorization": KEY}):
            r = httpx.request(method, url + path, headers=headers, verify=TLS)
            assert r.status_code == 401, (method, path)
            assert r.json()["status"] == "error"
            assert "Authorization" in r.json()["error"]
    for path in ("/health", "/", "/tags", "/app.js", "/favicon.ico"):
        assert httpx.get(url + path, verify=TLS).status_code == 200, path
    icon = httpx.get(url + "/favicon.ico", verify=TLS)  # every browser asks for it: no console error per load
    assert icon.headers["content-type"] == "image/svg+xml"
    assert icon.content.startswith(b"<svg")
    # The key works (and the dispatcher reaches the worker with the token); the job above may still run.
    assert httpx.get(url + "/status", headers=auth(), verify=TLS).json()["workers"][0]["status"] in ("idle", "busy")


def test_probes_answer_without_a_key_and_reveal_nothing(secured):
    """A load balancer's probe has no key: /health and /ready answer it; what /ready knows beyond ready or
    not (the worker count, a folder's path in a reason) only to a caller with the key."""
    url = secured.url
    assert httpx.get(url + "/health", verify=TLS).json()["status"] == "ok"
    bare = httpx.get(url + "/ready", verify=TLS)
    assert bare.status_code == 200
    assert bare.json() == {"status": "ready"}
    keyed = httpx.get(url + "/ready", headers=auth(), verify=TLS)
    assert keyed.json() == {"status": "ready", "workers_ready": 1}
    assert httpx.get(url + "/ready", headers=auth("wrong"), verify=TLS).json() == {"status": "ready"}


def test_workers_refuse_calls_without_the_token(secured):
    w = secured.workers[0].url
    assert httpx.get(w + "/health", verify=TLS).status_code == 200
    for method, path in [
        ("POST", "/generate"),
        ("GET", "/config"),
        ("GET", "/tasks/x"),
        ("POST", "/cancel/x"),
        ("GET", "/download/x.wav"),
        ("GET", "/ready"),
    ]:
        r = httpx.request(method, w + path, json={}, verify=TLS)
        assert r.status_code == 401, path
        assert r.json()["status"] == "error", path
        # Not "send Authorization: Bearer <key>" (read as "you need an API key"): where clients go.
        assert r.json()["error"].startswith("This is a songserve worker (port "), path
        assert "clients use the dispatcher" in r.json()["error"], path
    root = httpx.get(w + "/", verify=TLS)  # a browser pointed at a worker's port
    assert root.status_code == 200
    assert "not the API: clients use the dispatcher" in root.json()["note"]
    assert httpx.get(w + "/config", headers=auth(TOKEN), verify=TLS).status_code == 200


def test_track_files_reached_through_the_dispatcher_with_the_token(secured):
    r = httpx.post(
        secured.url + "/generate", json={"lyrics": "x", "duration": 0.05, "num_tracks": 1}, headers=auth(), verify=TLS
    )
    job_id = r.json()["job_id"]
    from tests.support.servers import wait_for

    wait_for(
        lambda: httpx.get(f"{secured.url}/job/{job_id}", headers=auth(), verify=TLS).json()["status"] == "completed",
        timeout=30,
    )
    assert httpx.get(f"{secured.url}/job/{job_id}/track/0/wav", headers=auth(), verify=TLS).status_code == 200


def test_a_browsers_reads_may_carry_the_key_in_a_cookie_and_nothing_else_may(secured):
    """<audio>, links and EventSource cannot send Authorization: GET and HEAD take the page's cookie."""
    url, cookie = secured.url, {"Cookie": f"theme=dark; songserve_key={KEY.replace('-', '%2D')}"}
    job = httpx.post(
        url + "/generate", json={"lyrics": "x", "duration": 0.05, "num_tracks": 1}, headers=auth(), verify=TLS
    )
    job_id = job.json()["job_id"]
    from tests.support.servers import wait_for

    wait_for(
        lambda: httpx.get(f"{url}/job/{job_id}", headers=cookie, verify=TLS).json()["status"] == "completed", timeout=30
    )
    wav = httpx.get(f"{url}/job/{job_id}/track/0/wav", headers=cookie, verify=TLS)
    assert wav.status_code == 200
    assert wav.content[:4] == b"RIFF"
    assert httpx.head(f"{url}/job/{job_id}/track/0/mp3", headers=cookie, verify=TLS).status_code == 200
    with httpx.stream("GET", f"{url}/job/{job_id}/events", headers=cookie, verify=TLS) as events:
        assert events.status_code == 200
    for bad in ({"Cookie": "songserve_key=wrong"}, {"Cookie": f"other_key={KEY}"}):
        assert httpx.get(f"{url}/job/{job_id}", headers=bad, verify=TLS).status_code == 401
    # A cookie never changes anything: what a cross-site form could send is refused and does nothing.
    body = {"lyrics": "x", "duration": 0.05, "num_tracks": 1}
    assert httpx.post(url + "/generate", json=body, headers=cookie, verify=TLS).status_code == 401
    assert httpx.delete(f"{url}/job/{job_id}", headers=cookie, verify=TLS).status_code == 401
    # A wrong header is not rescued by a right cookie.
    assert httpx.get(f"{url}/job/{job_id}", headers={**cookie, **auth("wrong")}, verify=TLS).status_code == 401


@pytest.fixture(scope="module")
def open_cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("open"), workers=1, delay=0.0, threads=True)
    yield c
    c.stop()


def test_body_size_limit(open_cluster):
    r = httpx.post(
        open_cluster.url + "/generate",
        content=b'{"lyrics": "' + b"a" * 2_000_000 + b'"}',
        headers={"Content-Type": "application/json"},
        verify=TLS,
    )
    assert r.status_code == 413
    assert r.json()["status"] == "error"

    def chunks():
        yield b'{"lyrics": "'
        for _ in range(40):
            yield b"a" * 50_000
        yield b'"}'

    r = httpx.post(
        open_cluster.url + "/generate", content=chunks(), headers={"Content-Type": "application/json"}, verify=TLS
    )
    assert r.status_code == 413


def test_cors_allows_localhost_dev_ports_only(open_cluster):
    def preflight(origin: str) -> httpx.Response:
        return httpx.options(
            open_cluster.url + "/generate",
            headers={
                "Origin": origin,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "content-type",
            },
            verify=TLS,
        )

    assert preflight("http://localhost:5173").headers.get("access-control-allow-origin") == "http://localhost:5173"
    assert "access-control-allow-origin" not in preflight("https://evil.example").headers


def test_traversal_on_every_file_route(open_cluster):
    url = open_cluster.url
    job_id = open_cluster.submit(num_tracks=1)["job_id"]
    open_cluster.wait_job(job_id)
    attempts = [
        f"/job/{job_id}/track/0/..%2F..%2Fjobs.sqlite3",
        f"/job/{job_id}/track/0/%2e%2e",
        f"/job/..%2F{job_id}/track/0/wav",
        f"/job/{job_id}/../../etc/passwd",
        "/job/%2Fetc%2Fpasswd/track/0/wav",
        f"/job/{job_id}%00/track/0/wav",
        f"/job/{job_id}/track/0/wav%00",
        f"/job/{job_id}/track/-1/wav",
        "/job/%2e%2e/track/0/wav",
        "/..%2Fstate%2Fjobs.sqlite3",
        "/%2e%2e/%2e%2e/etc/passwd",
    ]
    for path in attempts:
        r = httpx.get(url + path, verify=TLS)
        assert r.status_code in (400, 404, 422), path
        assert b"root:" not in r.content
        assert b"SQLite" not in r.content
    # A symlink placed where a result should be is not followed.
    results = open_cluster.tmp / "state" / "results" / job_id
    (results / "track_0.wav").unlink()
    (results / "track_0.wav").symlink_to("/etc/passwd")
    r = httpx.get(f"{url}/job/{job_id}/track/0/wav", verify=TLS)
    assert r.status_code == 410  # not followed: the track's file is gone
    assert b"root:" not in r.content
    w = open_cluster.workers[0].url
    for name in ("..%2F..%2Fetc%2Fpasswd", "%2Fetc%2Fpasswd", "x.wav%00", "%2e%2e", "...", "a%5Cb"):
        assert httpx.get(f"{w}/download/{name}", verify=TLS).status_code == 404, name


def _fuzz(base_url: str, max_examples: int) -> list[str]:
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_url(base_url + "/openapi.json")
    problems: list[str] = []
    for result in schema.get_all_operations():
        op = result.ok()

        @settings(
            max_examples=max_examples,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=op.as_strategy())
        def run(case) -> None:
            r = case.call(base_url=base_url, timeout=20)
            where = f"{case.method} {case.formatted_path} → {r.status_code}"
            if r.status_code >= 500:
                problems.append(f"{where}: server error {r.text[:200]}")
            elif r.status_code >= 400 and case.method != "HEAD":  # HEAD answers carry no body
                try:
                    body = r.json()
                except ValueError:
                    body = {}
                if body.get("status") not in ("error", "busy") or not body.get("error"):
                    problems.append(f"{where}: no error body: {r.text[:200]}")
            if "Traceback" in r.text or "/work/" in r.text or "site-packages" in r.text:
                problems.append(f"{where}: leaks internals")

        run()
    return problems


def test_schema_fuzzing_dispatcher(open_cluster):
    assert _fuzz(open_cluster.url, 30) == []


def test_schema_fuzzing_worker(tmp_path):
    w = start_worker(tmp_path, "--pipeline", "test", "--test-max-audio-sec", "0.5")  # fuzzed lengths up to 15 min
    try:
        w.wait_healthy()
        assert _fuzz(w.url, 30) == []
    finally:
        w.stop()
