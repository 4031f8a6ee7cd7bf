"""``run_backend.sh`` itself, as a newcomer runs it: real processes, real ports, then stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import soundfile as sf

from tests.support.http import TLS
from tests.support.launcher import launcher_env
from tests.support.servers import ROOT, wait_for, wait_launched


def pids(log_dir: Path) -> list[int]:
    return [int(p.read_text()) for p in log_dir.glob("*.pid")]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def test_two_cpu_workers_end_to_end_then_stop(tiny_dir, tmp_path):
    env = launcher_env(tmp_path)
    api = f"http://127.0.0.1:{env['API_PORT']}"
    out = open(tmp_path / "launcher.out", "wb")
    proc = subprocess.Popen(
        ["bash", "run_backend.sh", "--gpus", "0,1"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
    )
    try:
        wait_launched(proc, api, tmp_path / "launcher.out")
        started = pids(tmp_path / "logs")
        assert len(started) == 3
        st = httpx.get(api + "/status", verify=TLS).json()
        assert st["total_gpus"] == 2
        assert [w["url"].rsplit(":", 1)[1] for w in st["workers"]] == [
            env["WORKER_BASE_PORT"],
            str(int(env["WORKER_BASE_PORT"]) + 1),
        ]
        r = httpx.post(
            api + "/generate",
            json={"lyrics": "hello\nworld", "tags": "pop", "duration": 0.05, "num_tracks": 2},
            verify=TLS,
        )
        job_id = r.json()["job_id"]
        job = wait_for(
            lambda: (
                (j := httpx.get(f"{api}/job/{job_id}", verify=TLS).json())["status"] in ("completed", "failed") and j
            ),
            timeout=120,
            interval=0.3,
        )
        assert job["status"] == "completed"
        for i in range(2):
            mp3 = httpx.get(f"{api}/job/{job_id}/track/{i}/mp3", verify=TLS)
            assert mp3.status_code == 200
            assert mp3.headers["content-type"] == "audio/mpeg"
            (tmp_path / f"t{i}.mp3").write_bytes(mp3.content)
            assert sf.info(tmp_path / f"t{i}.mp3").duration > 2.5
        for name in ("api.log", "worker_0.log", "worker_1.log"):
            assert (tmp_path / "logs" / name).stat().st_size > 0
        # Worker i: seed BASE_SEED + i*1000.
        w1 = httpx.get(st["workers"][1]["url"] + "/health", headers={"Authorization": "Bearer x"}, verify=TLS).json()
        assert w1["seed"] == 1283 + 1000
        stop = subprocess.run(
            ["bash", "run_backend.sh", "stop"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
        )
        assert stop.returncode == 0, stop.stderr
        assert proc.wait(timeout=30) == 0  # the foreground launcher ends when its processes are gone
        assert not any(alive(p) for p in started)
        assert not list((tmp_path / "logs").glob("*.pid"))
    finally:
        if proc.poll() is None:
            subprocess.run(["bash", "run_backend.sh", "stop"], cwd=ROOT, env=env, timeout=120)
            proc.kill()
        proc.wait(timeout=30)
        out.close()


def test_wrong_checkpoint_path_fails_fast_with_the_path(tmp_path):
    env = launcher_env(tmp_path, CHECKPOINTS_DIR=str(tmp_path / "no-such-set"))
    out = subprocess.run(  # fails fast: the timeout bounds it (the health wait would take 600 s)
        ["bash", "run_backend.sh", "--no-follow"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=90
    )
    assert out.returncode != 0
    assert str(tmp_path / "no-such-set") in out.stderr
    assert "worker_0.log" in out.stderr
    assert not any(alive(p) for p in pids(tmp_path / "logs"))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpus", "0,x"], "--gpus must be"),
        (["--gpus", "1,1"], "lists an id twice"),
        (["--runtime-mode", "turbo"], "--runtime-mode must be"),
        (["--api-only"], "needs --worker-urls"),
        (["--frobnicate"], "unknown option"),
        (["--acestep-port", "x"], "--acestep-port must be a port number"),
        (["--workers-only", "--acestep-port", "8011"], "--acestep-port is a dispatcher setting"),
    ],
)
def test_bad_arguments_are_refused_with_one_line(tmp_path, args, message):
    out = subprocess.run(
        ["bash", "run_backend.sh", *args],
        cwd=ROOT,
        env=launcher_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 1
    assert message in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_stop_handles_stale_pid_files(tmp_path):
    env = launcher_env(tmp_path)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "worker_0.pid").write_text("999999\n")
    (tmp_path / "logs" / "api.pid").write_text(f"{os.getpid()}\n")  # alive but not ours: must not be killed
    out = subprocess.run(
        ["bash", "run_backend.sh", "stop"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0
    assert "stale pid file" in out.stdout
    assert not list((tmp_path / "logs").glob("*.pid"))


def test_stop_kills_what_ignores_sigterm_and_returns_once_it_is_gone(tmp_path):
    env = launcher_env(tmp_path, STOP_TIMEOUT="1")
    (tmp_path / "logs").mkdir()
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ignoring', flush=True); time.sleep(60)"
    stubborn = subprocess.Popen(  # its command line names backend_worker.py, so the launcher owns it
        [sys.executable, "-c", code, "backend_worker.py"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert stubborn.stdout is not None
        assert stubborn.stdout.readline() == "ignoring\n"  # SIGTERM is ignored from now on
        (tmp_path / "logs" / "worker_0.pid").write_text(f"{stubborn.pid}\n")
        out = subprocess.run(
            ["bash", "run_backend.sh", "stop"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=30
        )
        assert out.returncode == 0
        lines = out.stdout.splitlines()
        assert lines[:2] == [
            "run_backend: stopping: waiting for 1 worker(s) to stop; press Ctrl-C again to stop at once",
            "run_backend: worker_0 did not stop in 1s: killing",
        ]  # and no word about an api.pid that was never there
        assert lines[2].startswith("run_backend: stopped 1 processes in ")
        assert len(lines) == 3
        assert not alive(stubborn.pid)  # gone (or a zombie awaiting this test's wait) when stop returns
        assert stubborn.wait(timeout=5) == -signal.SIGKILL
    finally:
        stubborn.kill()
        stubborn.wait()
        if stubborn.stdout is not None:
            stubborn.stdout.close()
