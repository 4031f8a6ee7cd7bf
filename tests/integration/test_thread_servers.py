"""Servers in threads of the test process build their routes before they serve: two first requests at
once in two servers would otherwise build pydantic schemas in two threads at once, which pydantic does
not survive (a 500 seen in CI). Kept here so that a FastAPI that builds routes some other way shows."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from fastapi import routing as fastapi_routing

from tests.support import in_thread
from tests.support.http import TLS
from tests.support.servers import free_port

pytestmark = pytest.mark.quick


def test_thread_servers_build_no_route_while_serving(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    worker = in_thread.tone_worker(tmp_path, "--pipeline", "test", name="worker")
    ace = free_port()
    api = in_thread.dispatcher(tmp_path, [worker.url], "--acestep-port", str(ace))
    built: list[str] = []
    included = getattr(fastapi_routing, "_IncludedRouter", None)
    if included is not None:
        real = included._build_effective_context

        def spy(self: object, route: object) -> object:
            built.append(repr(route))
            return real(self, route)

        monkeypatch.setattr(included, "_build_effective_context", spy)
    try:
        api.wait_healthy()
        answers = {
            "worker /health": httpx.get(worker.url + "/health", verify=TLS).status_code,
            "worker, no such path": httpx.get(worker.url + "/nowhere", verify=TLS).status_code,
            "worker /generate, no body": httpx.post(worker.url + "/generate", verify=TLS).status_code,
            "dispatcher /jobs": httpx.get(api.url + "/jobs", verify=TLS).status_code,
            "dispatcher /generate, no body": httpx.post(api.url + "/generate", verify=TLS).status_code,
            "ACE-Step /v1/models": httpx.get(f"http://127.0.0.1:{ace}/v1/models", verify=TLS).status_code,
        }
    finally:
        api.stop()
        worker.stop()
    assert answers == {
        "worker /health": 200,
        "worker, no such path": 404,
        "worker /generate, no body": 422,
        "dispatcher /jobs": 200,
        "dispatcher /generate, no body": 422,
        "ACE-Step /v1/models": 200,
    }
    assert built == [], f"routes built while serving: {built[:3]}"
