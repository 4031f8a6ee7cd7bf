"""Relative path settings are the caller's, whichever setting it is, and errors print them whole.

The launcher runs from the repository (it ``cd``s there); a person gives paths relative to where they
typed the command. ``settings.caller_path`` resolves every path setting against that folder
(``SONGSERVE_CALLER_DIR``, which the launcher sets), so a setting the launcher does not know by name
(``API_KEYS_FILE`` was one) is not read from the repository instead.
"""

from __future__ import annotations

import json
import os
import signal
import uuid
from pathlib import Path

import httpx
import pytest

from songserve.api.settings import DispatcherSettings
from songserve.process.settings import CALLER_DIR_ENV, load_settings
from songserve.worker.settings import WorkerSettings
from tests.support.http import TLS
from tests.support.launcher import launcher_env, run_launcher
from tests.support.procs import MARK, marked
from tests.support.servers import ROOT


@pytest.mark.quick
def test_every_path_setting_is_taken_from_the_callers_folder(tmp_path, monkeypatch):
    monkeypatch.setenv(CALLER_DIR_ENV, str(tmp_path))
    d = load_settings(
        DispatcherSettings,
        ["--api-keys-file", "keys.json", "--tags-file", "tags.json", "--state-dir", "st", "--results-dir", "r"],
    )
    assert (d.api_keys_file, d.tags_file) == (tmp_path / "keys.json", tmp_path / "tags.json")
    assert (d.state_dir, d.results_dir) == (tmp_path / "st", tmp_path / "r")
    assert load_settings(DispatcherSettings, ["--tags-file", ""]).tags_file is None  # empty is unset
    w = load_settings(WorkerSettings, ["--checkpoints-dir", "sets/a", "--output-dir", "out"])
    assert (w.checkpoints_dir, w.output_dir) == (tmp_path / "sets" / "a", tmp_path / "out")
    assert load_settings(DispatcherSettings, ["--state-dir", "/abs/st"]).state_dir == Path("/abs/st")
    monkeypatch.delenv(CALLER_DIR_ENV)
    monkeypatch.chdir(tmp_path / "..")
    assert load_settings(DispatcherSettings, ["--api-keys-file", "k"]).api_keys_file == tmp_path.parent / "k"


@pytest.mark.process
def test_a_relative_api_keys_file_is_the_callers_and_its_error_prints_the_whole_path(tmp_path):
    caller = tmp_path / "here"
    caller.mkdir()
    mark = uuid.uuid4().hex
    env = launcher_env(tmp_path, API_KEYS_FILE="keys.json", **{MARK: mark})
    args = ["--api-only", "--worker-urls", "http://127.0.0.1:9", "--no-follow"]
    try:
        out = run_launcher(args, env, cwd=caller, timeout=120)
        assert out.returncode != 0
        assert f"Setting api_keys_file: {caller / 'keys.json'} cannot be used (No such file or directory)." in (
            out.stderr
        ), out.stderr
        assert str(ROOT / "keys.json") not in out.stderr
        (caller / "keys.json").write_text(json.dumps({"k-caller": {"name": "caller"}}))
        out = run_launcher(args, env, cwd=caller, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        api = f"http://127.0.0.1:{env['API_PORT']}"
        assert httpx.get(api + "/status", verify=TLS).status_code == 401
        assert (
            httpx.get(api + "/usage", headers={"Authorization": "Bearer k-caller"}, verify=TLS).json()["name"]
            == "caller"
        )
        # Each run's log is its own: the failed run's lines moved to api.log.1, not above this run's.
        logs = tmp_path / "logs"
        assert "cannot be used" in (logs / "api.log.1").read_text()
        assert "cannot be used" not in (logs / "api.log").read_text()
        assert run_launcher(["stop"], env, timeout=120).returncode == 0
    finally:
        for pid in marked(mark):
            os.kill(pid, signal.SIGKILL)
