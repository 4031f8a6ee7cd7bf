"""``songserve mcp``: the SDK's stdio client starts the real command, as docs/mcp.md's Claude Desktop snippet
says, and makes a song through it against a real dispatcher with tone workers (in threads): the tools, a
two-take song with progress, a take read as a resource (the HTTP download's bytes), a retake, a cancel,
another key's job not found; and the HTTP snippet's URL and header are what a client connects with.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import sys
from typing import Any

import httpx
import httpx2
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

from tests.support import in_thread
from tests.support.http import TLS
from tests.support.servers import ROOT, wait_for

KEYS = {"k-alice": {"name": "alice"}, "k-bob": {"name": "bob"}}
SONG = {"tags": "rock", "lyrics": "[verse]\nover stdio", "duration": 0.05}


def snippets() -> list[dict[str, Any]]:
    """docs/mcp.md's JSON blocks, parsed."""
    text = (ROOT / "docs" / "mcp.md").read_text(encoding="utf-8")
    return [json.loads(block) for block in re.findall(r"```json\n(.*?)```", text, re.S)]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mcp_stdio")
    (tmp / "keys.json").write_text(json.dumps(KEYS))
    workers = [in_thread.tone_worker(tmp, "--pipeline", "test", "--test-delay-s", "0.5", name=f"w{i}") for i in (0, 1)]
    for w in workers:
        w.wait_healthy()
    api = in_thread.dispatcher(tmp, [w.url for w in workers], "--api-keys-file", str(tmp / "keys.json"))
    api.wait_healthy(want=("ok",))
    auth = {"Authorization": "Bearer k-alice"}
    wait_for(lambda: httpx.get(api.url + "/status", headers=auth, verify=TLS).json()["idle_gpus"] == 2, timeout=30)
    yield api
    api.stop()
    for w in workers:
        w.stop()


def local_server(site, key: str | None) -> StdioServerParameters:
    """The Claude Desktop snippet, with this checkout's command and the test dispatcher's URL and key."""
    (http_snippet, desktop) = snippets()
    entry = desktop["mcpServers"]["songserve"]
    assert entry["args"] == ["mcp"]
    assert set(entry["env"]) == {"SONGSERVE_URL", "SONGSERVE_API_KEY"}
    assert entry["command"].endswith("/.venv/bin/songserve")
    command = ROOT / ".venv" / "bin" / "songserve"
    env = {"SONGSERVE_URL": site.url, **({"SONGSERVE_API_KEY": key} if key else {})}
    if command.exists():
        return StdioServerParameters(command=str(command), args=entry["args"], env=env)
    return StdioServerParameters(command=sys.executable, args=["-m", "songserve", *entry["args"]], env=env, cwd=ROOT)


def test_a_song_through_songserve_mcp_over_stdio(site):
    async def go() -> None:
        async with Client(local_server(site, "k-alice")) as c:
            assert "make_song" in {t.name for t in (await c.list_tools()).tools}
            made = await c.call_tool("make_song", {**SONG, "num_tracks": 2})
            assert not made.is_error, made.content
            job = made.structured_content["job_id"]
            heard: list[float] = []

            async def progress(p: float, total: float | None, message: str | None) -> None:
                heard.append(p)

            done = await c.call_tool("wait_for_job", {"job_id": job, "timeout_sec": 60}, progress_callback=progress)
            assert done.structured_content["status"] == "completed"
            assert heard
            blob = (await c.read_resource(f"song://{job}/0")).contents[0].blob
            http = httpx.get(
                f"{site.url}/job/{job}/track/0/mp3", headers={"Authorization": "Bearer k-alice"}, verify=TLS
            )
            assert base64.b64decode(blob) == http.content
            again = await c.call_tool("retake", {"job_id": job, "at_sec": 1.0, "num_tracks": 1})
            assert not again.is_error, again.content
            cancelled = await c.call_tool("cancel_job", {"job_id": again.structured_content["job_id"]})
            assert not cancelled.is_error
            bad = await c.call_tool("make_song", {"num_tracks": 99})
            assert bad.is_error
            assert "'num_tracks'" in bad.content[0].text
        async with Client(local_server(site, "k-bob")) as bob:
            other = await bob.call_tool("get_job", {"job_id": job})
            assert other.is_error
            assert f"Job {job} not found." == other.content[0].text

    asyncio.run(go())


def test_without_a_key_songserve_mcp_says_why_and_stops(site):
    async def go() -> None:
        async with Client(local_server(site, None)) as c:
            await c.list_tools()

    with pytest.raises(BaseExceptionGroup, match="unhandled errors"):  # the process ends: the client's transport fails
        asyncio.run(go())


def test_the_http_snippet_is_what_a_client_connects_with(site):
    entry = snippets()[0]["mcpServers"]["songserve"]
    assert entry["type"] == "http"
    assert entry["url"] == "http://127.0.0.1:8889/mcp"
    headers = {k: v.replace("<your API key>", "k-alice") for k, v in entry["headers"].items()}
    url = entry["url"].replace("http://127.0.0.1:8889", site.url)

    async def go() -> list[str]:
        async with httpx2.AsyncClient(headers=headers) as http:
            async with Client(streamable_http_client(url, http_client=http)) as c:
                return [t.name for t in (await c.list_tools()).tools]

    assert "wait_for_job" in asyncio.run(go())
