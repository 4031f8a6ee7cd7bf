"""The dispatcher's MCP server (``/mcp``), through the SDK's own client over real HTTP, against a real
dispatcher and tone workers (served in threads): the tools and their schemas, a two-take song followed
with progress, a take read as a resource (the same bytes as the HTTP download), a retake, a cancel;
keys (none: refused; another key's jobs: not found; a quota: the HTTP API's refusal); every hostile
argument an error naming it; and a few hundred concurrent waits while ``/health`` keeps answering.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from tests.support import in_thread
from tests.support.http import TLS
from tests.support.servers import Cluster, wait_for

KEYS = {"k-alice": {"name": "alice"}, "k-bob": {"name": "bob"}, "k-capped": {"name": "capped", "tracks_per_hour": 2}}
MCP_MAX_MB = 1.0
SONG = {"tags": "pop, piano", "lyrics": "[verse]\nhello world", "duration": 0.05}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mcp")
    (tmp / "keys.json").write_text(json.dumps(KEYS))
    workers = [in_thread.tone_worker(tmp, "--pipeline", "test", "--test-delay-s", "0.6", name=f"w{i}") for i in (0, 1)]
    for w in workers:
        w.wait_healthy()
    args = ("--api-keys-file", str(tmp / "keys.json"), "--mcp-max-mb", str(MCP_MAX_MB), "--max-queue", "2000")
    api = in_thread.dispatcher(tmp, [w.url for w in workers], *args)
    api.wait_healthy(want=("ok",))
    wait_for(
        lambda: httpx.get(api.url + "/status", headers=bearer("k-alice"), verify=TLS).json()["idle_gpus"] == 2,
        timeout=30,
    )
    yield api
    api.stop()
    for w in workers:
        w.stop()


@asynccontextmanager
async def session(site: Any, key: str | None = "k-alice", connections: int = 20) -> AsyncIterator[Client]:
    limits = httpx2.Limits(max_connections=connections, max_keepalive_connections=connections)
    headers = bearer(key) if key else {}
    async with httpx2.AsyncClient(headers=headers, limits=limits, timeout=httpx2.Timeout(30, read=120)) as http:
        async with Client(streamable_http_client(site.url + "/mcp", http_client=http)) as client:
            yield client


def text(result: Any) -> str:
    return str(result.content[0].text)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_the_tools_are_listed_with_their_schemas(site):
    async def go() -> None:
        async with session(site) as c:
            tools = {t.name: t for t in (await c.list_tools()).tools}
            assert set(tools) == {
                "make_song",
                "wait_for_job",
                "get_job",
                "list_jobs",
                "retake",
                "repaint",
                "extend_start",
                "cancel_job",
                "list_style_tags",
                "list_adapters",
                "upload_audio",
            }
            song = tools["make_song"].input_schema
            assert song["additionalProperties"] is False
            assert {"tags", "lyrics", "duration", "num_tracks", "seed"} <= set(song["properties"])
            assert "minutes" in song["properties"]["duration"]["description"]
            assert "0.05 to 10 minutes" in tools["make_song"].description  # this dispatcher's limits, in words
            assert "not fetch" in tools["upload_audio"].description
            assert tools["wait_for_job"].input_schema["required"] == ["job_id"]
            assert tools["cancel_job"].annotations.destructive_hint is True
            templates = {t.uri_template for t in (await c.list_resource_templates()).resource_templates}
            assert "song://{job_id}/{track}" in templates
            assert "song://{job_id}/{track}.wav" in templates

    run(go())


def test_a_two_take_song_with_progress_its_takes_as_resources_a_retake_and_a_cancel(site):
    async def go() -> None:
        async with session(site) as c:
            made = await c.call_tool("make_song", {**SONG, "num_tracks": 2, "seed": 7})
            assert not made.is_error, text(made)
            job = made.structured_content["job_id"]
            heard: list[tuple[float, float | None, str | None]] = []

            async def progress(p: float, total: float | None, message: str | None) -> None:
                heard.append((p, total, message))

            done = await c.call_tool("wait_for_job", {"job_id": job, "timeout_sec": 60}, progress_callback=progress)
            assert not done.is_error, text(done)
            body = done.structured_content
            assert body["ended"]
            assert body["status"] == "completed"
            assert heard
            assert all(total == 100 for _, total, _ in heard)
            assert "take 1" in str(heard[-1][2])
            assert [t["resource"] for t in body["takes"]] == [f"song://{job}/0", f"song://{job}/1"]
            links = [b for b in done.content if b.type == "resource_link"]
            assert [str(link.uri) for link in links] == [f"song://{job}/0", f"song://{job}/1"]

            for uri, path, mime in (
                (f"song://{job}/1", "1/mp3", "audio/mpeg"),
                (f"song://{job}/0.wav", "0/wav", "audio/wav"),
            ):
                got = (await c.read_resource(uri)).contents[0]
                assert got.mime_type == mime
                http = httpx.get(f"{site.url}/job/{job}/track/{path}", headers=bearer("k-alice"), verify=TLS)
                assert http.status_code == 200
                assert base64.b64decode(got.blob) == http.content
                assert body["takes"][int(path[0])][f"{path[2:]}_url"] == f"{site.url}/job/{job}/track/{path}"
            lyrics = (await c.read_resource(f"song://{job}/lyrics")).contents[0]
            assert "hello world" in lyrics.text
            assert (await c.read_resource(f"song://{job}/style")).contents[0].text == "pop, piano"

            again = await c.call_tool("retake", {"job_id": job, "track_index": 1, "at_sec": 1.0, "num_tracks": 1})
            assert not again.is_error, text(again)
            assert again.structured_content["adjusted"] == {}
            redone = await c.call_tool("wait_for_job", {"job_id": again.structured_content["job_id"]})
            assert redone.structured_content["status"] == "completed", text(redone)

            queued = await c.call_tool("make_song", {**SONG, "duration": 0.2, "num_tracks": 1})
            cancelled = await c.call_tool("cancel_job", {"job_id": queued.structured_content["job_id"]})
            assert not cancelled.is_error
            assert cancelled.structured_content["status"] == "cancelled"
            listed = await c.call_tool("list_jobs", {"limit": 3})
            assert [j["job_id"] for j in listed.structured_content["jobs"]][2] == job
            tags = await c.call_tool("list_style_tags", {})
            assert "Piano" in tags.structured_content["vocal_instrument"]["tags"]

    run(go())


def test_a_part_repainted_an_opening_written_and_the_adapters_listed(site):
    async def go() -> None:
        async with session(site) as c:
            made = await c.call_tool("make_song", {**SONG, "num_tracks": 1, "seed": 3})
            job = made.structured_content["job_id"]
            assert (await c.call_tool("wait_for_job", {"job_id": job})).structured_content["status"] == "completed"
            ends = {}
            for tool, args in (
                ("repaint", {"at_sec": 1.0, "end_sec": 2.0, "num_tracks": 2, "lyrics": "[verse]\nnew words"}),
                ("extend_start", {"before_sec": 1.0}),
                ("repaint", {"parts": [{"at_sec": 0.5, "end_sec": 1.0}, {"at_sec": 2.2, "end_sec": 2.6}]}),
            ):
                asked = await c.call_tool(tool, {"job_id": job, "track_index": 0, **args})
                assert not asked.is_error, text(asked)
                ended = await c.call_tool("wait_for_job", {"job_id": asked.structured_content["job_id"]})
                assert ended.structured_content["status"] == "completed", text(ended)
                ends[tool if tool not in ends else "parts"] = ended.structured_content
            assert len(ends["parts"]["tracks"][0]["metadata"]["repainted"]["parts"]) == 2
            painted = [t["metadata"]["repainted"] for t in ends["repaint"]["tracks"]]
            assert len(painted) == 2
            assert all(p["origin"] == f"{job}/0" for p in painted)
            assert all(p["start_frame"] < p["join_frame"] for p in painted)
            assert ends["extend_start"]["tracks"][0]["metadata"]["repainted"]["opening"] > 0
            original = (await c.call_tool("get_job", {"job_id": job})).structured_content["takes"][0]["duration_sec"]
            assert ends["extend_start"]["takes"][0]["duration_sec"] > original

            for bad, named in (({"at_sec": 1.0, "end_sec": float("nan")}, "end_sec"), ({"at_sec": 2.0}, "end_sec")):
                refused = await c.call_tool("repaint", {"job_id": job, **bad})
                assert refused.is_error
                assert f"'{named}'" in text(refused), text(refused)

            listed = await c.call_tool("list_adapters", {})
            assert not listed.is_error
            assert listed.structured_content == {"adapters": []}  # the tone workers offer none
            refused = await c.call_tool("make_song", {**SONG, "adapter": "studio-a"})
            assert refused.is_error
            assert "'adapter'" in text(refused)
            assert "no worker here can load adapter 'studio-a'" in text(refused)

    run(go())


def test_without_a_key_nothing_is_served(site):
    r = httpx.post(
        site.url + "/mcp",
        json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
        headers={"Accept": "application/json, text/event-stream"},
        verify=TLS,
    )
    assert r.status_code == 401
    assert r.json()["error"].startswith("Missing or wrong credentials")
    wrong = httpx.post(site.url + "/mcp", content=b"{" * 10_000_000, headers=bearer("k-nobody"), verify=TLS)
    assert wrong.status_code == 401  # before the body is read

    async def go() -> None:
        with pytest.raises(BaseExceptionGroup, match="unhandled errors"):  # the transport's 401, in the SDK's group
            async with session(site, key=None) as c:
                await c.list_tools()

    run(go())


def test_another_keys_job_is_not_found_and_a_quota_applies_as_on_http(site):
    async def go() -> None:
        async with session(site, "k-alice") as alice, session(site, "k-bob") as bob:
            made = await alice.call_tool("make_song", {**SONG, "num_tracks": 1})
            job = made.structured_content["job_id"]
            for name, args in (
                ("get_job", {"job_id": job}),
                ("wait_for_job", {"job_id": job, "timeout_sec": 5}),
                ("cancel_job", {"job_id": job}),
                ("retake", {"job_id": job, "at_sec": 1.0}),
            ):
                got = await bob.call_tool(name, args)
                assert got.is_error, name
                assert job in text(got), (name, text(got))
                assert re.search("not (found|known)", text(got)), (name, text(got))
            with pytest.raises(MCPError, match="not found"):
                await bob.read_resource(f"song://{job}/0")
            assert job not in json.dumps((await bob.call_tool("list_jobs", {})).structured_content)
            assert (await alice.call_tool("get_job", {"job_id": job})).structured_content["job_id"] == job
        async with session(site, "k-capped") as capped:
            assert not (await capped.call_tool("make_song", {**SONG, "num_tracks": 2})).is_error
            over = await capped.call_tool("make_song", {**SONG, "num_tracks": 1})
        http = httpx.post(
            site.url + "/generate", json={**SONG, "num_tracks": 1}, headers=bearer("k-capped"), verify=TLS
        )
        assert over.is_error
        assert http.status_code == 429
        digits = re.compile(r"\d+ s\.$")
        assert digits.sub("", text(over)) == digits.sub("", http.json()["error"])  # the HTTP API's sentence

    run(go())


HOSTILE = [
    ("make_song", {"num_tracks": "many"}, "num_tracks"),
    ("make_song", {"num_tracks": 99}, "num_tracks"),
    ("make_song", {"seed": -1}, "seed"),
    ("make_song", {"duration": 999, "lyrics": "x"}, "duration"),
    ("make_song", {"duration": [1]}, "duration"),
    ("make_song", {"durration": 1}, "durration"),
    ("make_song", {"mode": "rap", "lyrics": "x"}, "mode"),
    ("make_song", {"lyrics": "x" * 50_001}, "lyrics"),
    ("make_song", {"continue_from": {"job_id": "0123456789abcdef"}}, "continue_from"),
    ("retake", {"job_id": "../../etc", "at_sec": 1}, "job_id"),
    ("retake", {"job_id": "0123456789abcdef"}, "at_sec"),
    ("retake", {"job_id": "0123456789abcdef", "at_sec": -3}, "at_sec"),
    ("repaint", {"job_id": "0123456789abcdef", "at_sec": 1.0, "parts": [{"at_sec": 1, "end_sec": 2}] * 2}, "parts"),
    ("repaint", {"job_id": "0123456789abcdef", "end_sec": 1.0}, "at_sec"),
    ("repaint", {"job_id": "0123456789abcdef", "at_sec": 1.0, "end_sec": 2.0, "duration": 1.0}, "duration"),
    ("extend_start", {"job_id": "0123456789abcdef", "before_sec": -1.0}, "before_sec"),
    ("make_song", {**SONG, "adapter_scale": 9.0}, "adapter_scale"),
    ("wait_for_job", {"job_id": "0123456789abcdef", "timeout_sec": 3600}, "timeout_sec"),
    ("wait_for_job", {"job_id": 5}, "job_id"),
    ("get_job", {}, "job_id"),
    ("list_jobs", {"limit": 0}, "limit"),
    ("list_jobs", {"cursor": "'; drop table jobs"}, "cursor"),
    ("upload_audio", {"audio_base64": "not base64!"}, "audio_base64"),
    ("upload_audio", {"audio_base64": "A" * (4 * int(MCP_MAX_MB * 2**20) // 3 + 8)}, "audio_base64"),
    ("upload_audio", {"audio_base64": base64.b64encode(b"RIFF not audio").decode()}, "file"),
]


@pytest.mark.parametrize(("tool", "args", "named"), HOSTILE, ids=[f"{t}-{n}" for t, _, n in HOSTILE])
def test_a_hostile_argument_is_the_tools_error_naming_it(site, tool, args, named):
    async def go() -> str:
        async with session(site) as c:
            got = await c.call_tool(tool, args)
            assert got.is_error, text(got)
            return text(got)

    said = run(go())
    assert f"'{named}'" in said, said
    assert said.endswith("."), said
    if tool == "make_song" and named in ("num_tracks", "seed"):  # the HTTP API's own sentence
        assert (
            said == httpx.post(site.url + "/generate", json=args, headers=bearer("k-alice"), verify=TLS).json()["error"]
        )


def test_an_unknown_tool_a_bad_resource_and_a_message_over_the_body_limit(site):
    async def go() -> None:
        async with session(site) as c:
            got = await c.call_tool("delete_everything", {})
            assert got.is_error
            assert "'delete_everything'" in text(got)
            assert "make_song" in text(got)
            with pytest.raises(MCPError, match="No resource"):
                await c.read_resource("file:///etc/passwd")
            with pytest.raises(MCPError, match="not found"):
                await c.read_resource("song://0123456789abcdef/0")

    run(go())
    huge = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": "upload_audio", "arguments": {"audio_base64": "A" * 3_000_000}},
    }
    r = httpx.post(
        site.url + "/mcp",
        json=huge,
        headers={**bearer("k-alice"), "Accept": "application/json, text/event-stream"},
        verify=TLS,
    )
    assert r.status_code == 413
    assert "MCP_MAX_MB" in r.json()["error"]


def test_a_small_upload_is_stored_and_can_be_continued(site, tmp_path):
    import numpy as np
    import soundfile as sf

    path = tmp_path / "tone.wav"
    sf.write(path, 0.1 * np.sin(np.arange(44_100) / 10.0).astype("float32"), 44_100)

    async def go() -> None:
        async with session(site) as c:
            up = await c.call_tool(
                "upload_audio", {"audio_base64": base64.b64encode(path.read_bytes()).decode(), "filename": "tone.wav"}
            )
            assert not up.is_error, text(up)
            made = await c.call_tool(
                "make_song", {**SONG, "num_tracks": 1, "continue_from": up.structured_content["continue_with"]}
            )
            assert not made.is_error, text(made)
            done = await c.call_tool("wait_for_job", {"job_id": made.structured_content["job_id"]})
            assert done.structured_content["status"] == "completed", text(done)

    run(go())


def test_hundreds_of_concurrent_waits_keep_health_answering(tmp_path):
    """Waits hold no track and no worker: /health answers all along, and every wait ends with the job's state.
    The dispatcher is a process of its own here: in a thread it would share this process's interpreter with
    the 300 clients' side of each request."""
    n, answers, stop = 300, [], threading.Event()
    # One client process opens the 300 connections: on a busy machine it may take longer than the 10 s the
    # dispatcher gives a connection to send its headers (its guard against slow clients), so give it more.
    cluster = Cluster(tmp_path, workers=1, delay=0.6, api_args=("--max-queue", "2000", "--header-timeout-sec", "120"))
    site = cluster.api

    def poll() -> None:
        with httpx.Client(timeout=60, verify=TLS) as http:
            while not stop.is_set():
                answers.append(http.get(site.url + "/health").status_code)

    async def go() -> list[Any]:
        async with session(site, connections=n + 10) as c:
            made = await c.call_tool("make_song", {**SONG, "num_tracks": 2})
            job = made.structured_content["job_id"]
            return await asyncio.gather(
                *(c.call_tool("wait_for_job", {"job_id": job, "timeout_sec": 20}) for _ in range(n))
            )

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        results = run(go())
    finally:
        stop.set()
        poller.join()
        cluster.stop()
    assert len(results) == n
    assert not any(r.is_error for r in results), [text(r) for r in results if r.is_error][:3]
    assert {r.structured_content["job_id"] for r in results} == {results[0].structured_content["job_id"]}
    assert answers
    assert set(answers) == {200}
