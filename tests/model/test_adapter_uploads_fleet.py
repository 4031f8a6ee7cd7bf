"""Uploaded adapters through the whole fleet: a real dispatcher (our port and ACE-Step's, three keys) over a
real tiny-set worker, over HTTP; a second worker joins (announced) after the upload.

What a person sees: key A uploads the tiny set's adapter files under a new name; a take with it
completes and names it; key B does not see it, cannot use it (the 422 of an unknown name, on both
ports) nor delete it (404); a bad upload is a 422 naming the file and the reason and leaves nothing;
a worker that joins later is sent it; A deletes it, the workers drop it, a take naming it is a 422.
And the hostile side: no key (401, before the body), a key not allowed (403), too large (413), a bad
name or a missing file (422), a taken name (409).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import subprocess
import sys
from typing import Any

import httpx
import httpx2
import pytest
import torch
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from songserve.pipeline.adapters.format import CONFIG, WEIGHTS
from songserve.pipeline.adapters.safetensors_file import read_safetensors, write_safetensors
from songserve.pipeline.tiny.adapters import write_tiny_adapters
from songserve.pipeline.tiny.build import tiny_arch
from tests.support.http import TLS
from tests.support.servers import ROOT, ServerProcess, cluster_of, free_port, start_worker, wait_for

WAIT = 600.0  # seconds: tiny-set takes are seconds on an idle core, minutes under the suite's load
SONG = {"tags": "pop", "lyrics": "[verse]\nla la", "duration": 0.05}
A, B, C = "k-studio", "k-other", "k-third"
TOKEN = "uploads-worker-token"


@pytest.fixture(scope="module")
def fleet(tiny_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("adapter_uploads")
    folder = write_tiny_adapters(tmp / "adapters", {k: tiny_arch(k, 1024) for k in ("backbone", "superres")})
    flags = ("--runtime-mode", "keep_loaded", "--adapters-dir", str(folder), "--max-adapters", "2")
    worker = start_worker(tmp, *flags, name="first", env={"WORKER_TOKEN": TOKEN})
    keys = tmp / "keys.json"
    keys.write_text(
        json.dumps(
            {
                A: {"name": "studio", "upload_adapters": True},
                B: {"name": "other"},
                C: {"name": "third", "upload_adapters": True},
            }
        )
    )
    ace = free_port()
    c = cluster_of(
        tmp,
        [worker],
        "--api-keys-file",
        str(keys),
        "--acestep-port",
        str(ace),
        "--worker-token",
        TOKEN,
        "--adapter-max-mb",
        "1",
    )
    c.ace = f"http://127.0.0.1:{ace}"
    c.folder, c.flags, c.tmp = folder, flags, tmp
    yield c
    c.stop()


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def files_of(folder, config: bytes | None = None, weights: bytes | None = None) -> dict:
    return {
        "config": (CONFIG, config if config is not None else (folder / CONFIG).read_bytes(), "application/json"),
        "weights": (
            WEIGHTS,
            weights if weights is not None else (folder / WEIGHTS).read_bytes(),
            "application/octet-stream",
        ),
    }


def upload(fleet, name: str, key: str | None = A, files: dict | None = None) -> httpx.Response:
    return httpx.post(
        f"{fleet.url}/adapters",
        data={"name": name},
        files=files if files is not None else files_of(fleet.folder / "tiny-a"),
        headers=auth(key) if key else {},
        timeout=120,
        verify=TLS,
    )


def listed(fleet, key: str) -> list[str]:
    r = httpx.get(f"{fleet.url}/adapters", headers=auth(key), timeout=30, verify=TLS)
    return [a["name"] for a in r.json()["adapters"]]


def field_of(r: httpx.Response) -> str:
    return r.json()["detail"][0]["loc"][-1]


def generate(fleet, key: str, **body) -> httpx.Response:
    return httpx.post(f"{fleet.url}/generate", json={**SONG, **body}, headers=auth(key), timeout=30, verify=TLS)


def uploaded_on(url: str) -> dict[str, str]:
    return httpx.get(url + "/health", timeout=30, verify=TLS).json()["adapters"]["uploaded"]


def weights_with(folder, edit) -> bytes:
    tensors = read_safetensors(folder / WEIGHTS)
    edit(tensors)
    out = folder.parent / "edited.safetensors"
    write_safetensors(out, tensors)
    return out.read_bytes()


def nan(tensors):
    key = next(iter(tensors))
    tensors[key] = torch.full_like(tensors[key], math.nan)


def wrong_shape(tensors):
    key = next(k for k in tensors if k.endswith("lora_A.weight"))
    tensors[key] = torch.zeros(tensors[key].shape[0], tensors[key].shape[1] + 3)


def test_the_hostile_uploads_are_refused_before_anything_is_kept(fleet):
    assert upload(fleet, "x", key=None).status_code == 401
    r = upload(fleet, "x", key=B)
    assert r.status_code == 403, r.text
    assert "'other'" in r.json()["error"]
    assert r.json()["limit"]["name"] == "upload_adapters"
    big = {"config": (CONFIG, b"{}", "application/json"), "weights": (WEIGHTS, b"\0" * (2 << 20), "x/y")}
    r = upload(fleet, "x", files=big)
    assert r.status_code == 413, r.text
    assert "ADAPTER_MAX_MB" in r.json()["error"]
    r = upload(fleet, "../x")
    assert (r.status_code, field_of(r)) == (422, "name")
    r = upload(fleet, "x", files={"config": files_of(fleet.folder / "tiny-a")["config"]})
    assert (r.status_code, field_of(r)) == (422, "weights")
    r = upload(fleet, "tiny-a")  # a name of the workers' own folder
    assert (r.status_code, field_of(r)) == (409, "name")
    assert "taken" in r.json()["error"]


@pytest.mark.parametrize(
    ("what", "field", "reason"),
    [
        ("nan", "weights", "NaN"),
        ("shapes", "weights", "this model needs"),
        ("junk", "weights", "safetensors"),
        ("base", "config", "base model"),
    ],
)
def test_a_bad_adapter_is_a_422_naming_the_file_and_the_reason_and_leaves_nothing(fleet, what, field, reason):
    tiny = fleet.folder / "tiny-a"
    files = {
        "nan": lambda: files_of(tiny, weights=weights_with(tiny, nan)),
        "shapes": lambda: files_of(tiny, weights=weights_with(tiny, wrong_shape)),
        "junk": lambda: files_of(tiny, weights=b"not a safetensors file at all"),
        "base": lambda: files_of(tiny, config=(tiny / CONFIG).read_bytes().replace(b'"tiny"', b'"another-model"')),
    }[what]()
    r = upload(fleet, "bad", files=files)
    assert (r.status_code, field_of(r)) == (422, field), r.text
    assert reason in r.json()["error"]
    assert "bad" not in listed(fleet, A)
    assert uploaded_on(fleet.workers[0].url) == {}
    kept = fleet.tmp / "state" / "results" / "adapters"
    assert not kept.exists() or list(kept.iterdir()) == []


def test_an_upload_serves_its_key_and_no_other(fleet):
    r = upload(fleet, "mine")
    assert r.status_code == 201, r.text
    view = r.json()
    digest = hashlib.sha256((fleet.folder / "tiny-a" / WEIGHTS).read_bytes()).hexdigest()
    assert (view["name"], view["owner"], view["sha256"], view["rank"], view["workers"]) == (
        "mine",
        "studio",
        digest,
        8,
        [0],
    )
    assert "mine" in listed(fleet, A)
    assert "mine" not in listed(fleet, B)
    assert "tiny-a" in listed(fleet, B)
    sent = generate(fleet, A, adapter="mine", seed=5)
    assert sent.status_code == 200, sent.text
    done = fleet.wait_job(sent.json()["job_id"], timeout=WAIT, headers=auth(A))
    assert done["status"] == "completed", done
    assert done["tracks"][0]["metadata"]["adapter"]["name"] == "mine"
    refused = generate(fleet, B, adapter="mine")
    assert (refused.status_code, field_of(refused)) == (422, "adapter")
    assert "'mine'" in refused.json()["error"]
    assert "studio" not in refused.json()["error"]
    ace = httpx.post(fleet.ace + "/v1/lora/load", json={"lora_path": "mine"}, headers=auth(B), timeout=30, verify=TLS)
    assert ace.json()["code"] == 400, ace.text
    assert httpx.delete(f"{fleet.url}/adapters/mine", headers=auth(B), timeout=30, verify=TLS).status_code == 404
    taken = upload(fleet, "mine", key=C)
    assert (taken.status_code, field_of(taken)) == (409, "name")
    assert "studio" not in taken.json()["error"]
    fleet_own = httpx.delete(f"{fleet.url}/adapters/tiny-a", headers=auth(A), timeout=30, verify=TLS)
    assert fleet_own.status_code == 409


def test_a_worker_that_joins_later_is_sent_the_upload(fleet):
    digest = uploaded_on(fleet.workers[0].url)["mine"]
    port = free_port()
    late = ServerProcess(
        [
            "backend_worker.py",
            "--worker-port",
            str(port),
            "--master-port",
            "0",
            "--output-dir",
            str(fleet.tmp / "late_audio"),
            *fleet.flags,
            "--announce",
            fleet.url,
            "--announce-interval-sec",
            "0.5",
        ],
        port,
        fleet.tmp / "late.log",
        env={"WORKER_TOKEN": TOKEN},
    )
    fleet.workers.append(late)  # stopped with the fleet
    late.wait_healthy(timeout=WAIT)
    assert wait_for(lambda: uploaded_on(late.url).get("mine") == digest, timeout=120)


def test_an_assistant_sees_and_uses_an_upload_through_mcp_as_its_key_does(fleet):
    async def tools(key: str) -> tuple[list[str], Any]:
        async with httpx2.AsyncClient(headers=auth(key), timeout=httpx2.Timeout(30, read=120)) as http:
            async with Client(streamable_http_client(fleet.url + "/mcp", http_client=http)) as client:
                listed = await client.call_tool("list_adapters", {})
                made = await client.call_tool("make_song", {**SONG, "adapter": "mine", "adapter_scale": 0.5})
                return [a["name"] for a in listed.structured_content["adapters"]], made

    names, made = asyncio.run(tools(A))
    assert "mine" in names
    assert not made.is_error, made.content[0].text
    done = fleet.wait_job(made.structured_content["job_id"], timeout=WAIT, headers=auth(A))
    assert done["status"] == "completed", done
    assert done["tracks"][0]["metadata"]["adapter"] == {"name": "mine", "scale": 0.5, "rank": 8}
    names, made = asyncio.run(tools(B))
    assert "mine" not in names
    assert "tiny-a" in names
    assert made.is_error
    assert "'adapter'" in made.content[0].text


def test_a_deleted_upload_leaves_every_worker_and_cannot_be_used(fleet):
    r = httpx.delete(f"{fleet.url}/adapters/mine", headers=auth(A), timeout=30, verify=TLS)
    assert r.status_code == 200, r.text
    assert r.json()["name"] == "mine"
    for w in fleet.workers:
        assert wait_for(lambda w=w: "mine" not in uploaded_on(w.url), timeout=60)
    assert "mine" not in listed(fleet, A)
    refused = generate(fleet, A, adapter="mine")
    assert (refused.status_code, field_of(refused)) == (422, "adapter")
    assert httpx.delete(f"{fleet.url}/adapters/mine", headers=auth(A), timeout=30, verify=TLS).status_code == 404


def test_the_command_line_uploads_a_folder_lists_it_as_the_keys_and_deletes_it(fleet):
    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "songserve", "--server", fleet.url, "--api-key", C, "adapters", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )

    up = cli("upload", str(fleet.folder / "tiny-b"), "--name", "from-cli")
    assert up.returncode == 0, up.stderr
    assert up.stdout.startswith("adapter from-cli: uploaded (rank ")
    listing = cli()
    assert "from-cli: rank " in listing.stdout
    assert "uploaded by third" in listing.stdout
    gone = cli("delete", "from-cli")
    assert gone.returncode == 0, gone.stderr
    assert "from-cli" not in listed(fleet, C)
