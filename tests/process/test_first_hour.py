"""The first hour, as a new user meets the service: one test per rough edge such a user would meet.

Real processes throughout: a dispatcher with no workers (jobs just queue) for what a request is
answered, a tiny-model worker behind a dispatcher for progress and logs, the launcher for the
token, ``--gpus``, relative paths and ``stop``, and the page in headless Chromium.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import uuid

import httpx
import pytest

from tests.support import in_thread
from tests.support.http import TLS
from tests.support.launcher import NOISE, launcher_env, run_launcher
from tests.support.procs import MARK, marked
from tests.support.servers import ROOT, free_port, wait_for
from tests.support.tiny_site import lent, tiny_site

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# The tests that run the launcher, in the launcher's serial unit (tests/support/schedule.py); the rest of
# the file is a unit of its own.
LAUNCHER_TESTS = {
    "test_the_launchers_first_start_says_only_what_a_person_can_act_on_and_stop_leaves_no_process",
    "test_gpus_on_a_host_without_cuda_says_what_it_starts_instead",
    "test_a_relative_checkpoints_dir_is_the_callers_and_its_error_is_the_full_path",
}


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """A dispatcher with no workers, and a tone worker of its own (not in its pool) for the worker's routes."""
    tmp = tmp_path_factory.mktemp("bare")
    api = in_thread.dispatcher(tmp, [])
    worker = in_thread.tone_worker(tmp)
    try:
        api.wait_healthy(want=("ok",))
        worker.wait_healthy()
        yield api, worker
    finally:
        api.stop()
        worker.stop()


@pytest.fixture(scope="module")
def site(shared_tiny, tmp_path_factory):
    with tiny_site(shared_tiny, tmp_path_factory.mktemp("first_hour")) as c:
        yield c  # the process's tiny-model worker behind a dispatcher of this file's own


# ---- what a request is answered -----------------------------------------------------------------


def test_misspelled_fields_are_reported_and_an_empty_body_is_not_silent(bare):
    api, _ = bare
    r = httpx.post(api.url + "/generate", json={"lyric": "hello\nworld", "durration": 0.05, "tags": "pop"}, verify=TLS)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["ignored"] == ["lyric", "durration"]
    assert "'lyric' is not a field and was ignored; did you mean 'lyrics'?" in body["notes"]
    assert "'durration' is not a field and was ignored; did you mean 'duration'?" in body["notes"]
    assert r.headers["Warning"].startswith("299 songserve ")
    empty = httpx.post(api.url + "/generate", json={}, verify=TLS)
    assert empty.status_code == 200
    assert empty.json()["ignored"] == []
    assert "Warning" not in empty.headers
    assert any("none of the known fields" in n for n in empty.json()["notes"])
    assert any("vocal without words" in n for n in empty.json()["notes"])
    for job in (body, empty.json()):
        httpx.delete(f"{api.url}/job/{job['job_id']}", verify=TLS)
    assert "ignored 2 unknown fields: lyric, durration" in api.log_tail()


def routes(url: str) -> dict[str, set[str]]:
    """Each path of a service's OpenAPI document, with concrete ids, and the methods it takes."""
    doc = httpx.get(url + "/openapi.json", verify=TLS).json()
    out = {}
    for path, ops in doc["paths"].items():
        concrete = path.replace("{idx}", "0").replace("{worker_id}", "1").replace("{kind}", "mp3")
        concrete = concrete.replace("{job_id}", "abc").replace("{task_id}", "t1").replace("{filename}", "x.wav")
        out[concrete] = {m.upper() for m in ops}
    return out


@pytest.mark.parametrize("service", ["dispatcher", "worker"])
def test_every_wrong_method_is_405_naming_the_allowed_ones(bare, service):
    api, worker = bare
    url = api.url if service == "dispatcher" else worker.url
    table = routes(url)
    if service == "dispatcher":
        assert table["/generate"] == {"POST"}
        table.update({p: {"GET", "HEAD"} for p in ("/", "/index.html", "/app.js", "/style.css")})  # the page
    checked = 0
    for path, allowed in table.items():
        for method in {"GET", "POST", "PUT", "PATCH", "DELETE"} - allowed:
            r = httpx.request(method, url + path, verify=TLS)
            assert r.status_code == 405, (method, path, r.status_code, r.text)
            assert set(r.headers["Allow"].split(", ")) == allowed, (method, path, r.headers["Allow"])
            assert r.json()["status"] == "error"
            assert f"{method} is not allowed on {path}" in r.json()["error"]
            checked += 1
    assert checked > 20
    assert httpx.post(url + "/no/such/route", verify=TLS).status_code == 404  # a path nobody serves is not a 405


@pytest.mark.parametrize("service", ["dispatcher", "worker"])
def test_malformed_json_is_answered_with_its_line_and_column(bare, service):
    api, worker = bare
    url = api.url if service == "dispatcher" else worker.url
    text = '{\n  "lyrics": "hello",\n  "duration": ,\n}'
    with pytest.raises(json.JSONDecodeError) as where:
        json.loads(text)
    r = httpx.post(url + "/generate", content=text, headers={"Content-Type": "application/json"}, verify=TLS)
    assert r.status_code == 422
    body = r.json()
    assert f"at line {where.value.lineno}, column {where.value.colno}" in body["error"], body
    assert body["error"].startswith("The body is not valid JSON: Expecting value")
    assert body["detail"][0]["line"] == where.value.lineno == 3
    assert body["detail"][0]["column"] == where.value.colno


# ---- the model worker: progress, the tiny flag, quiet logs ----------------------------------------


def test_progress_moves_through_the_decode_and_the_files(site):
    job = site.submit(duration=1.0, num_tracks=1, lyrics="hello\nworld")
    seen: list[tuple[str, int]] = []

    def done() -> bool:
        t = site.job(job["job_id"])["tracks"][0]
        seen.append((t["status"], t["progress"]))
        return t["status"] in ("done", "error")

    wait_for(done, timeout=300, interval=0.05)
    decoding = sorted({p for s, p in seen if s == "decoding"})
    print(f"\nprogress while decoding: {decoding}")
    assert seen[-1] == ("done", 100)
    assert len([p for p in decoding if 90 < p < 99]) >= 2, seen  # it moves through the decode, not 90 then 99
    assert max(p for s, p in seen if s != "done") <= 99


def test_every_tiny_set_says_it_is_tiny(site, shared_release):
    assert httpx.get(site.workers[0].url + "/config", verify=TLS).json()["tiny_checkpoints"] is True
    with lent(shared_release) as w:  # the process's worker on the release-shaped set (tests/support/tiny_site.py)
        config = httpx.get(w.url + "/config", verify=TLS).json()
        assert config["checkpoint_layout"] == "release"
        assert config["tiny_checkpoints"] is True


def test_third_party_startup_noise_is_silenced_unless_debug(site, tmp_path):
    httpx.get(
        site.url + "/openapi.json", verify=TLS
    ).raise_for_status()  # where FastAPI warned of a duplicate operation id
    httpx.get(site.url + "/docs", verify=TLS).raise_for_status()
    # The dispatcher's log from its start (FastAPI's duplicate operation id); a cold worker's whole log,
    # from a fresh interpreter that builds the set and loads it: tests/process/test_left_behind.py.
    logs = site.api.log_tail(200_000)
    assert "workers: " in logs, logs[-2000:]  # the log from the dispatcher's start
    assert not [n for n in NOISE if n in logs]
    worker_log = site.workers[0].log_tail(2_000_000)
    assert "models ready in" in worker_log  # from the worker's start, which loaded the set
    assert "process group:" not in worker_log  # a detail for LOG_LEVEL=debug: nothing to act on

    def build(level: str) -> str:
        env = {**os.environ, "LOG_LEVEL": level}
        cmd = [sys.executable, "-m", "songserve.pipeline.tiny", "--out", str(tmp_path / level), "--force"]
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stderr

    # Without LOG_LEVEL the build is quiet: tests/process/test_left_behind.py reads a worker's log of one.
    loud = build("debug")
    assert "Transformer Engine and Apex are not installed" in loud


# ---- the repository and the page ------------------------------------------------------------------


def test_the_clis_songs_folder_is_ignored_by_git():
    out = subprocess.run(["git", "check-ignore", "-q", "songs/take0.mp3"], cwd=ROOT, capture_output=True)
    assert out.returncode == 0, "songs/ (python -m songserve generate --out songs/) is not in .gitignore"


def test_the_pages_header_says_what_it_shows_and_when(bare):
    if CHROMIUM is None:
        pytest.fail("chromium is not installed: scripts/test installs Debian's chromium package")
    from playwright.sync_api import sync_playwright

    api, _ = bare
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page()
        page.goto(api.url + "/")
        header = page.locator("#server-status")
        page.wait_for_function(
            "/ · as of \\d\\d:\\d\\d:\\d\\d$/.test(document.querySelector('#server-status').textContent)"
        )
        first = header.inner_text()
        assert first.startswith("0/0 workers idle · ")
        assert header.get_attribute("title") == "From GET /status, asked every 5 s while this page is open."
        # It does ask again: the time it shows moves on (waiting on the page, not on a clock here).
        page.wait_for_function(
            "(t) => document.querySelector('#server-status').textContent !== t", arg=first, timeout=30_000
        )
        browser.close()


# ---- the launcher -------------------------------------------------------------------------------


# What the first start may say (each a line a newcomer acts on or needs); anything else is noise.
FIRST_START_NOISE = ("pip skipped", "harmless", "worker token", "process group", "gloo", "==> ")


@pytest.mark.process
def test_the_launchers_first_start_says_only_what_a_person_can_act_on_and_stop_leaves_no_process(tiny_dir, tmp_path):
    mark = uuid.uuid4().hex
    env = launcher_env(tmp_path, **{MARK: mark})
    env.pop("WORKER_TOKEN", None)
    env.pop("LOG_LEVEL", None)
    try:
        up = run_launcher(["--no-follow"], env)
        assert up.returncode == 0, up.stdout + up.stderr
        token_file = tmp_path / "logs" / "worker_token"
        noise = [ln for ln in up.stdout.splitlines() if any(n in ln for n in FIRST_START_NOISE)]
        assert not noise, up.stdout  # the token is in its file; the workers listen on loopback only
        assert "run_backend: ready: " in up.stdout
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        assert token not in up.stdout  # named, not printed
        worker = f"http://127.0.0.1:{env['WORKER_BASE_PORT']}"
        refused = httpx.get(worker + "/config", verify=TLS)
        assert refused.status_code == 401
        assert "LOG_DIR/worker_token" in refused.json()["error"]  # where a person who needs it finds it
        config = httpx.get(worker + "/config", headers={"Authorization": f"Bearer {token}"}, verify=TLS)
        assert config.status_code == 200
        assert config.json()["tiny_checkpoints"] is True
        started = marked(mark)
        assert len(started) >= 2  # the dispatcher and the worker (and nothing needs more)
        down = run_launcher(["stop"], env, timeout=120)
        assert down.returncode == 0, down.stderr
        assert wait_for(lambda: not marked(mark), timeout=15, interval=0.2) is True
        assert not token_file.exists()
    finally:
        left = marked(mark)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert not left, f"left behind by run_backend.sh stop: {left}"


def four_free_ports() -> int:
    import socket

    while True:
        base = free_port()
        try:
            for i in range(1, 4):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue


@pytest.mark.process
def test_gpus_on_a_host_without_cuda_says_what_it_starts_instead(tmp_path):
    import torch

    if torch.cuda.device_count():
        pytest.skip("this host has CUDA: --gpus starts one worker per GPU, as asked")
    mark = uuid.uuid4().hex
    env = launcher_env(tmp_path, PIPELINE="test", WORKER_BASE_PORT=str(four_free_ports()), **{MARK: mark})
    try:
        up = run_launcher(["--workers-only", "--gpus", "0,1,2,3", "--no-follow"], env)
        assert up.returncode == 0, up.stdout + up.stderr
        assert (
            "run_backend: no CUDA device found: --gpus 0,1,2,3 starts 4 workers on the CPU instead, one process "
            "each sharing this machine's" in up.stdout
        ), up.stdout
        assert "starting worker 3 on the CPU" in up.stdout
        assert "on GPU" not in up.stdout
        assert run_launcher(["stop"], env, timeout=120).returncode == 0
        wait_for(lambda: not marked(mark), timeout=15, interval=0.2)
    finally:
        for pid in marked(mark):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.process
def test_a_relative_checkpoints_dir_is_the_callers_and_its_error_is_the_full_path(tmp_path):
    caller = tmp_path / "here"
    caller.mkdir()
    env = launcher_env(tmp_path, CHECKPOINTS_DIR="sets/khala")
    out = run_launcher(["--no-follow"], env, cwd=caller, timeout=120)
    assert out.returncode != 0
    assert f"CHECKPOINTS_DIR {caller / 'sets' / 'khala'} does not exist" in out.stderr, out.stderr
    assert str(ROOT / "sets") not in out.stderr  # not the repository's
    (caller / "sets").mkdir()
    (caller / "sets" / "khala").write_text("not a folder")
    out = run_launcher(["--no-follow"], env, cwd=caller, timeout=120)
    assert f"CHECKPOINTS_DIR {caller / 'sets' / 'khala'} is not a folder" in out.stderr, out.stderr
