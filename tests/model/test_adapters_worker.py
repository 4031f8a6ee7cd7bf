"""A real worker with ADAPTERS_DIR over real HTTP: a take on an adapter records it, /health lists what
the worker holds, and a name not in the folder fails that take as a request error naming ``adapter``."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from songserve.api.workers.client import WorkerClient, WorkerHttp
from songserve.pipeline.adapters.format import CONFIG, WEIGHTS
from songserve.pipeline.tiny.adapters import write_tiny_adapters
from songserve.pipeline.tiny.build import tiny_arch
from tests.support.http import TLS
from tests.support.servers import start_worker


@pytest.fixture(scope="module")
def worker(tiny_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("adapters_worker")
    folder = write_tiny_adapters(tmp / "adapters", {k: tiny_arch(k, 1024) for k in ("backbone", "superres")})
    w = start_worker(
        tmp, "--runtime-mode", "keep_loaded", "--adapters-dir", str(folder), "--max-adapters", "2", name="adapters"
    )
    w.wait_healthy()
    w.folder = folder  # the tiny set's adapters, to upload under other names
    yield w
    w.stop()


def _generate(worker, **body):
    payload = {"lyrics": "[verse]\nla la", "tags": "pop", "duration": 1 / 60, "seed_override": 3, **body}
    return httpx.post(worker.url + "/generate", json=payload, timeout=180, verify=TLS)


def test_a_take_on_an_adapter_records_it_and_health_lists_it(worker):
    health = httpx.get(worker.url + "/health", timeout=30, verify=TLS).json()
    assert health["adapters"]["resident"] == []
    assert health["adapters"]["capacity"] == 2
    assert health["adapters"]["available"] == ["tiny-a", "tiny-b", "tiny-c", "tiny-sr"]
    r = _generate(worker, adapter="tiny-sr", adapter_scale=1.5, task_id="ad1")
    assert r.status_code == 200, r.text
    meta = json.loads(httpx.get(f"{worker.url}/download/{r.json()['json_filename']}", timeout=30, verify=TLS).content)
    assert meta["adapter"] == {"name": "tiny-sr", "scale": 1.5, "rank": 4}
    resident = httpx.get(worker.url + "/health", timeout=30, verify=TLS).json()["adapters"]["resident"]
    assert [(a["name"], a["rank"], a["hits"]) for a in resident] == [("tiny-sr", 4, 1)]
    assert resident[0]["targets"] == ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    assert resident[0]["bytes"] > 0


def test_an_adapter_not_in_the_folder_fails_the_take_as_a_request_error(worker):
    r = _generate(worker, adapter="not-there", task_id="ad2")
    assert r.status_code == 400, r.text
    assert "adapter" in r.text
    assert "not-there" in r.text
    task = httpx.get(worker.url + "/tasks/ad2", timeout=30, verify=TLS).json()
    assert task["error_kind"] == "request"


def _put(worker, name: str, folder) -> dict:
    files = {
        "config": (CONFIG, (folder / CONFIG).read_bytes(), "application/json"),
        "weights": (WEIGHTS, (folder / WEIGHTS).read_bytes(), "application/octet-stream"),
    }
    r = httpx.put(f"{worker.url}/adapters/{name}", files=files, timeout=60, verify=TLS)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_delete_for_one_copy_keeps_another_copy_of_the_name(worker):
    """Two dispatchers of one store may upload one name at once: the one whose row lost tells the workers
    to remove its copy only (``sha256``), so the winner's copy, if it came last, stays. Through the
    dispatcher's own client (``WorkerClient.delete_adapter``) over real HTTP."""
    first = _put(worker, "raced", worker.folder / "tiny-a")["sha256"]
    second = _put(worker, "raced", worker.folder / "tiny-b")["sha256"]  # another dispatcher's copy, sent last
    assert first != second

    refused = httpx.delete(f"{worker.url}/adapters/raced", params={"sha256": first}, timeout=30, verify=TLS)
    assert refused.status_code == 409, refused.text
    assert "sha256" in refused.json()["error"]
    assert "kept" in refused.json()["error"]
    assert _uploaded(worker) == {"raced": second}
    bad = httpx.delete(f"{worker.url}/adapters/raced", params={"sha256": "not-hex"}, timeout=30, verify=TLS)
    assert bad.status_code == 422
    assert "sha256" in bad.text

    async def client_calls() -> list[bool]:
        async with httpx.AsyncClient(verify=TLS) as http:
            client = WorkerClient(WorkerHttp.shared(http), worker.url)
            return [
                await client.delete_adapter("raced", first),  # another copy: kept, False
                await client.delete_adapter("raced", second),  # its own: removed
                await client.delete_adapter("raced", second),  # none left: nothing to keep either
            ]

    assert asyncio.run(client_calls()) == [False, True, True]
    assert _uploaded(worker) == {}


def _uploaded(worker) -> dict[str, str]:
    return httpx.get(worker.url + "/health", timeout=30, verify=TLS).json()["adapters"]["uploaded"]
