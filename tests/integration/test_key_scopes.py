"""What each API key sees (``keys.py``: ``sees``), through a real dispatcher, a tone worker and both ports.

A key of ``API_KEYS_FILE`` sees the jobs and uploads made with its own name only; another key's
answer 404 as ones that do not exist, on every route that reads, streams, cancels, deletes or
continues them, and on the ACE-Step port. A key with ``"sees": "all"`` (an operator's) and the single
``API_KEY`` see everything.
"""

from __future__ import annotations

import hashlib
import io
import json
import math

import httpx
import numpy as np
import pytest
import soundfile as sf

from songserve.api.service.keys import ApiKeys
from songserve.errors import ConfigError
from tests.support import in_thread
from tests.support.http import TLS
from tests.support.servers import free_port, wait_for

KEYS = {"k-alice": {"name": "alice"}, "k-bob": {"name": "bob"}, "k-ops": {"name": "ops", "sees": "all"}}
BODY = {"lyrics": "[verse]\nmine alone", "duration": 0.05, "num_tracks": 1, "seed": 5}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


ALICE, BOB, OPS = bearer("k-alice"), bearer("k-bob"), bearer("k-ops")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("key_scopes")
    (tmp / "keys.json").write_text(json.dumps(KEYS))
    worker = in_thread.tone_worker(tmp, "--pipeline", "test", "--test-delay-s", "0.3")
    worker.wait_healthy()
    ace = free_port()
    api = in_thread.dispatcher(tmp, [worker.url], "--api-keys-file", str(tmp / "keys.json"), "--acestep-port", str(ace))
    api.wait_healthy(want=("ok",))
    wait_for(lambda: httpx.get(api.url + "/status", headers=OPS, verify=TLS).json()["idle_gpus"] == 1, timeout=30)
    api.ace = f"http://127.0.0.1:{ace}"  # type: ignore[attr-defined]
    yield api
    api.stop()
    worker.stop()


def finished_job(site, headers: dict[str, str]) -> str:
    r = httpx.post(site.url + "/generate", json=BODY, headers={**headers, "Prefer": "wait=30"}, timeout=60, verify=TLS)
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "completed"
    return str(r.json()["job_id"])


def test_another_keys_job_is_not_found_on_any_route_and_nothing_is_done_to_it(site):
    job = finished_job(site, ALICE)
    base = f"{site.url}/job/{job}"
    reads = [
        "",
        "/events",
        "/track/0/wav",
        "/track/0/mp3",
        "/track/0/codes",
        "/track/0/render?format=wav",
        "/track/0/stream?format=wav",
    ]
    for path in reads:
        for method in ("GET", "HEAD") if path.startswith("/track") else ("GET",):
            r = httpx.request(method, base + path, headers=BOB, timeout=10, verify=TLS)
            assert r.status_code == 404, (method, path, r.status_code)
            if method == "GET":
                assert r.json()["error"] == f"Job {job} not found.", path  # as one that does not exist
        assert httpx.get(base + path, headers=ALICE, timeout=30, verify=TLS).status_code == 200, path
        assert httpx.get(base + path, headers=OPS, timeout=30, verify=TLS).status_code == 200, path  # sees all
    assert httpx.delete(base, headers=BOB, verify=TLS).status_code == 404

    # Continuing it, or reusing its Idempotency-Key: refused, naming the field, as for an unknown job.
    retake = {**BODY, "continue_from": {"job_id": job, "track_index": 0, "at_sec": 1.0}}
    r = httpx.post(site.url + "/generate", json=retake, headers=BOB, verify=TLS)
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["body", "continue_from", "job_id"]
    assert "not known here" in r.json()["error"]
    assert httpx.post(site.url + "/generate", json=retake, headers=ALICE, verify=TLS).status_code == 200

    first = httpx.post(site.url + "/generate", json=BODY, headers={**ALICE, "Idempotency-Key": "nightly-1"}, verify=TLS)
    assert first.status_code == 200
    r = httpx.post(site.url + "/generate", json=BODY, headers={**BOB, "Idempotency-Key": "nightly-1"}, verify=TLS)
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["body", "Idempotency-Key"]
    assert "another API key" in r.json()["error"]
    again = httpx.post(site.url + "/generate", json=BODY, headers={**ALICE, "Idempotency-Key": "nightly-1"}, verify=TLS)
    assert again.json()["job_id"] == first.json()["job_id"]


def test_a_key_lists_its_own_jobs_and_an_operators_key_lists_every_one(site):
    mine = [finished_job(site, ALICE), finished_job(site, ALICE)]
    theirs = finished_job(site, BOB)

    def listed(headers: dict[str, str], **query: str | int) -> dict:
        r = httpx.get(site.url + "/jobs", params={"limit": 100, **query}, headers=headers, timeout=10, verify=TLS)
        assert r.status_code == 200, r.text
        return r.json()

    alice = [j["job_id"] for j in listed(ALICE)["jobs"]]
    assert alice[:2] == mine[::-1]  # newest first
    assert theirs not in alice
    assert theirs in [j["job_id"] for j in listed(BOB)["jobs"]]
    assert not set(mine) & {j["job_id"] for j in listed(BOB)["jobs"]}
    every = [j["job_id"] for j in listed(OPS)["jobs"]]
    assert every[:3] == [theirs, *mine[::-1]]  # sees all: every key's jobs
    # One page at a time, each below the last: the same jobs, in the same order, ending with no cursor.
    paged, cursor = [], None
    while True:
        page = listed(ALICE, limit=1, **({"cursor": cursor} if cursor else {}))
        paged += [j["job_id"] for j in page["jobs"]]
        if (cursor := page["next_cursor"]) is None:
            break
    assert paged == alice
    assert httpx.get(site.url + "/jobs", timeout=10, verify=TLS).status_code == 401  # no key: no list


def test_another_keys_upload_is_not_found_and_cannot_be_continued_or_deleted(site):
    t = np.arange(2 * 44100) / 44100
    buf = io.BytesIO()
    sf.write(buf, np.stack([0.3 * np.sin(2 * math.pi * 220 * t)] * 2, 1), 44100, format="WAV")
    up = httpx.post(
        site.url + "/uploads", files={"file": ("demo.wav", buf.getvalue())}, headers=ALICE, timeout=30, verify=TLS
    )
    assert up.status_code == 200, up.text
    upload = up.json()["upload_id"]
    wait_for(
        lambda: httpx.get(f"{site.url}/uploads/{upload}", headers=ALICE, verify=TLS).json()["status"] == "ready", 60
    )
    for path in ("", "/codes"):
        assert httpx.get(f"{site.url}/uploads/{upload}{path}", headers=BOB, verify=TLS).status_code == 404
        assert httpx.get(f"{site.url}/uploads/{upload}{path}", headers=ALICE, verify=TLS).status_code == 200
        assert httpx.get(f"{site.url}/uploads/{upload}{path}", headers=OPS, verify=TLS).status_code == 200
    body = {**BODY, "continue_from": {"upload_id": upload}}
    r = httpx.post(site.url + "/generate", json=body, headers=BOB, verify=TLS)
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["body", "continue_from", "upload_id"]
    assert httpx.delete(f"{site.url}/uploads/{upload}", headers=BOB, verify=TLS).status_code == 404
    assert (
        httpx.get(f"{site.url}/uploads/{upload}", headers=ALICE, verify=TLS).json()["status"] == "ready"
    )  # still there
    assert httpx.post(site.url + "/generate", json=body, headers=ALICE, verify=TLS).status_code == 200


def test_on_the_acestep_port_another_keys_task_is_unknown_and_its_audio_not_found(site):
    job = finished_job(site, ALICE)

    def query(key: str) -> dict:
        r = httpx.post(
            site.ace + "/query_result", json={"ai_token": key, "task_id_list": [job]}, timeout=10, verify=TLS
        )
        return r.json()["data"][0]

    assert "not known here" in query("k-bob")["error"]
    mine = json.loads(query("k-alice")["result"])
    assert mine[0]["file"]
    audio = site.ace + mine[0]["file"] if mine[0]["file"].startswith("/") else mine[0]["file"]
    assert httpx.get(audio, headers={"Authorization": "k-alice"}, timeout=30, verify=TLS).status_code == 200
    assert httpx.get(audio, headers={"Authorization": "k-bob"}, timeout=30, verify=TLS).status_code == 404
    assert httpx.get(audio, headers={"Authorization": "k-ops"}, timeout=30, verify=TLS).status_code == 200


def test_sees_is_read_from_the_keys_file_and_a_bad_value_names_the_field(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({**KEYS, "k-anon": {}}))
    keys = ApiKeys.load("single", path)
    seen = {c.name: c.sees_all for c in (keys.identify(k.encode()) for k in [*KEYS, "k-anon", "single"]) if c}
    anon = "key-" + hashlib.sha256(b"k-anon").hexdigest()[:8]
    assert seen == {"alice": False, "bob": False, "ops": True, anon: False, "default": True}
    path.write_text(json.dumps({"k-x": {"sees": "everyone"}}))
    with pytest.raises(ConfigError, match="an entry's sees"):
        ApiKeys.load("", path)


def test_the_keys_file_is_read_again_when_it_changes_and_a_bad_one_changes_nothing(tmp_path):
    path = tmp_path / "keys.json"

    def write(text: str) -> None:  # as an operator's editor or deploy does: a new file renamed over the old
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(path)

    def status(key: str) -> int:
        return httpx.get(api.url + "/usage", headers=bearer(key) if key else {}, timeout=10, verify=TLS).status_code

    write(json.dumps({"k-alice": {"name": "alice"}}))
    api = in_thread.dispatcher(tmp_path, [], "--api-keys-file", str(path))
    try:
        api.wait_healthy(want=("ok", "degraded", "unavailable"))
        assert (status("k-alice"), status("k-carol")) == (200, 401)
        write(json.dumps({"k-alice": {"name": "alice"}, "k-carol": {"name": "carol", "tracks_per_hour": 3}}))
        wait_for(lambda: status("k-carol") == 200, timeout=20)  # a new key, without a restart
        assert (
            httpx.get(api.url + "/usage", headers=bearer("k-carol"), verify=TLS).json()["limits"]["tracks_per_hour"]
            == 3
        )

        write("{not json")
        wait_for(lambda: "cannot be used (not JSON" in api.log_path.read_text(), timeout=20)
        write("{}")
        wait_for(lambda: "now holds no key" in api.log_path.read_text(), timeout=20)
        assert (status("k-alice"), status("k-carol"), status("")) == (200, 200, 401)  # as they were

        write(json.dumps({"k-carol": {"name": "carol"}}))
        wait_for(lambda: status("k-alice") == 401, timeout=20)  # a key removed
        assert status("k-carol") == 200
        logged = api.log_path.read_text()
        assert "k-alice" not in logged  # keys are never logged, only their names
        assert "k-carol" not in logged
    finally:
        api.stop()
