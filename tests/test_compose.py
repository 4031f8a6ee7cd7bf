"""The program and the tests start one dispatcher: ``main`` and ``tests/in_thread.py`` both check with
``compose.check`` and serve the app whose lifespan is ``compose.build``; a bad setting refuses both alike."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from songserve.api import compose, main
from songserve.errors import ConfigError
from tests import in_thread

pytestmark = pytest.mark.quick


class Assembled:
    """``compose.assemble`` as it is, remembering the settings of each dispatcher it made."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.ports: list[int] = []
        real = compose.assemble

        def spy(checked: compose.Checked, *args: Any) -> compose.Parts:
            self.ports.append(checked.s.port)
            return real(checked, *args)

        monkeypatch.setattr(compose, "assemble", spy)


class Served:
    """Stands in for ``GracefulServer``: keeps the app ``main`` would serve instead of serving it."""

    app: Any = None

    def __init__(self, config: Any, drain: Any) -> None:
        Served.app = config.app

    def run(self, sockets: Any = None) -> None:
        pass


def flags(tmp: Path, *more: str) -> list[str]:
    return ["--state-dir", str(tmp / "state"), "--num-workers", "0", "--drain-timeout-sec", "0", *more]


def main_refusal(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, args: list[str]) -> str:
    """What ``main`` prints when it refuses to start (it must refuse: exit status 2)."""
    monkeypatch.setattr(main, "setup_logging", lambda *a: None)  # the test process keeps its own log handlers
    assert main.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dispatcher: "), err
    assert "\n" not in err, err  # one line
    return err.removeprefix("dispatcher: ")


def test_main_and_the_in_thread_dispatcher_are_made_by_the_same_build(tmp_path, monkeypatch):
    made = Assembled(monkeypatch)
    monkeypatch.setattr("songserve.serving.GracefulServer", Served)
    monkeypatch.setattr(main, "setup_logging", lambda *a: None)
    assert main.main(["--port", "18555", *flags(tmp_path / "main")]) == 0
    with TestClient(Served.app) as client:  # the lifespan: compose.build
        assert client.get("/health").json()["status"] == "ok"
    assert made.ports == [18555]

    server = in_thread.dispatcher(tmp_path / "thread", [])
    try:
        assert server.wait_healthy(want=("ok",))["status"] == "ok"
        assert made.ports == [18555, server.port]
    finally:
        server.stop()


def test_a_bad_keys_file_refuses_main_and_the_in_thread_dispatcher_alike(tmp_path, monkeypatch, capsys):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"a key with spaces": {"name": "x"}}))
    said = main_refusal(capsys, monkeypatch, flags(tmp_path, "--api-keys-file", str(keys)))
    assert said == f"Setting api_keys_file: {keys} has a key that is empty or holds spaces."
    with pytest.raises(ConfigError) as refused:
        in_thread.dispatcher(tmp_path, [], "--api-keys-file", str(keys))
    assert str(refused.value) == said


def test_an_unreachable_postgresql_store_refuses_main_and_the_in_thread_dispatcher_alike(tmp_path, monkeypatch, capsys):
    url = "postgresql://songserve@127.0.0.1:1/songserve"  # port 1: refused at once
    said = main_refusal(capsys, monkeypatch, flags(tmp_path, "--store-url", url))
    assert said.startswith("The job store "), said
    assert "cannot be opened" in said
    with pytest.raises(ConfigError) as refused:
        in_thread.dispatcher(tmp_path, [], "--store-url", url)
    assert str(refused.value) == said
