"""Adapters through the whole fleet: a real dispatcher (our port and ACE-Step's, two keys) over a real
tiny-set worker with the tiny adapter set in its ``ADAPTERS_DIR`` and two slots, over HTTP.

What a person sees: ``GET /adapters`` lists what the worker can load; one job's three takes on two
adapters and none complete, each recording its adapter; a retake of each take uses that take's
adapter without naming it; four adapters in turn on a two-slot worker never hold more than two and
never fail a take; ACE-Step's ``/v1/lora/load`` makes the calling key's later tasks use an adapter
while the other key's tasks keep the base model.
"""

from __future__ import annotations

import json

import httpx
import pytest

from songserve.pipeline.tiny.adapters import write_tiny_adapters
from songserve.pipeline.tiny.build import tiny_arch
from tests.support.http import TLS
from tests.support.servers import cluster_of, free_port, start_worker

WAIT = 600.0  # seconds: tiny-set takes are seconds on an idle core, minutes under the suite's load
SONG = {"tags": "pop", "lyrics": "[verse]\nla la", "duration": 0.05}
STUDIO, OTHER = "k-studio", "k-other"


@pytest.fixture(scope="module")
def fleet(tiny_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("adapters_fleet")
    folder = write_tiny_adapters(tmp / "adapters", {k: tiny_arch(k, 1024) for k in ("backbone", "superres")})
    worker = start_worker(
        tmp, "--runtime-mode", "keep_loaded", "--adapters-dir", str(folder), "--max-adapters", "2", name="lora"
    )
    keys = tmp / "keys.json"
    keys.write_text(json.dumps({STUDIO: {"name": "studio"}, OTHER: {"name": "other"}}))
    ace = free_port()
    c = cluster_of(tmp, [worker], "--api-keys-file", str(keys), "--acestep-port", str(ace))
    c.ace = f"http://127.0.0.1:{ace}"
    yield c
    c.stop()


def auth(key: str = STUDIO) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def post(fleet, key: str = STUDIO, **body) -> dict:
    r = httpx.post(f"{fleet.url}/generate", json=body, headers=auth(key), timeout=30, verify=TLS)
    assert r.status_code == 200, r.text
    job_id = r.json()["job_id"]
    done = fleet.wait_job(job_id, timeout=WAIT, headers=auth(key))
    assert done["status"] == "completed", done
    return done


def adapters_of(done: dict) -> list[str | None]:
    return [(t["metadata"].get("adapter") or {}).get("name") for t in done["tracks"]]


def test_the_fleet_lists_what_its_worker_can_load(fleet):
    listed = httpx.get(f"{fleet.url}/adapters", headers=auth(), timeout=30, verify=TLS).json()["adapters"]
    assert [a["name"] for a in listed] == ["tiny-a", "tiny-b", "tiny-c", "tiny-sr"]
    assert all(a["workers"] == [0] for a in listed)


def test_three_takes_on_two_adapters_and_none_and_each_retake_keeps_its_takes_adapter(fleet):
    takes = [{"adapter": "tiny-a"}, {"adapter": "tiny-b", "adapter_scale": 0.5}, {"adapter": None}]
    done = post(fleet, **SONG, num_tracks=3, seed=7, takes=takes)
    assert adapters_of(done) == ["tiny-a", "tiny-b", None]
    assert done["tracks"][1]["metadata"]["adapter"]["scale"] == 0.5
    for index, name in enumerate(["tiny-a", "tiny-b", None]):
        cf = {"job_id": done["job_id"], "track_index": index, "at_sec": 1.0}
        again = post(fleet, continue_from=cf, num_tracks=1, seed=11)
        assert adapters_of(again) == [name], (index, again["tracks"][0]["metadata"])


def test_four_adapters_in_turn_on_two_slots_never_hold_more_than_two_and_never_fail(fleet):
    for name in ["tiny-a", "tiny-b", "tiny-c", "tiny-sr", "tiny-a"]:
        done = post(fleet, **SONG, num_tracks=1, adapter=name, seed=3)
        assert adapters_of(done) == [name]
        health = httpx.get(fleet.workers[0].url + "/health", timeout=30, verify=TLS).json()["adapters"]
        assert len(health["resident"]) <= 2, health
        assert name in [a["name"] for a in health["resident"]]


def test_acesteps_lora_load_applies_to_the_calling_keys_tasks_only(fleet):
    r = httpx.post(fleet.ace + "/v1/lora/load", json={"lora_path": "/loras/tiny-c"}, headers=auth(), verify=TLS)
    assert r.json()["code"] == 200, r.text
    httpx.post(fleet.ace + "/v1/lora/scale", json={"scale": 0.8}, headers=auth(), verify=TLS)
    task = {"prompt": "pop", "lyrics": "[verse]\nla", "audio_duration": 10, "batch_size": 1}
    mine = httpx.post(fleet.ace + "/release_task", json=task, headers=auth(), verify=TLS).json()["data"]["task_id"]
    theirs = httpx.post(fleet.ace + "/release_task", json=task, headers=auth(OTHER), verify=TLS).json()["data"][
        "task_id"
    ]
    a = fleet.wait_job(mine, timeout=WAIT, headers=auth())
    b = fleet.wait_job(theirs, timeout=WAIT, headers=auth(OTHER))
    assert a["tracks"][0]["metadata"]["adapter"] == {"name": "tiny-c", "scale": 0.8, "rank": 2}
    assert "adapter" not in b["tracks"][0]["metadata"]
    status = httpx.get(fleet.ace + "/v1/lora/status", headers=auth(OTHER), verify=TLS).json()["data"]
    assert status["lora_loaded"] is False
    httpx.post(fleet.ace + "/v1/lora/toggle", json={"use_lora": False}, headers=auth(), verify=TLS)
    again = httpx.post(fleet.ace + "/release_task", json=task, headers=auth(), verify=TLS).json()["data"]["task_id"]
    assert "adapter" not in fleet.wait_job(again, timeout=WAIT, headers=auth())["tracks"][0]["metadata"]
