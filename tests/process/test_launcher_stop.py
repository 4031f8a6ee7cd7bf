"""Stopping through the real launcher, as a person does it: Ctrl-C in the terminal (SIGINT to the
launcher's whole process group), once to stop in order, twice to stop at once.

What a stop must do: one line at once saying what it waits
for and how to stop at once; the dispatcher's drain said once; the workers kept up until the
dispatcher has collected the takes finished during the drain and deleted them on the worker.
"""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from pathlib import Path

import httpx

from tests.support.http import TLS
from tests.support.launcher import launcher_env
from tests.support.procs import MARK, marked
from tests.support.servers import ROOT, wait_for

PLAN = (
    "run_backend: stopping: waiting for the dispatcher to finish its running tracks and collect their files "
    "(up to 30s), then 1 worker(s) to stop; press Ctrl-C again to stop at once"
)


class Launcher:
    """``bash run_backend.sh`` in the foreground of a terminal of its own (a new session)."""

    def __init__(self, tmp: Path, delay: str) -> None:
        self.mark = uuid.uuid4().hex
        self.tmp = tmp
        self.env = launcher_env(
            tmp, PIPELINE="test", TEST_DELAY_S=delay, OUTPUT_DIR=str(tmp / "out"), **{MARK: self.mark}
        )
        self.api = f"http://127.0.0.1:{self.env['API_PORT']}"
        self.out_path = tmp / "launcher.out"
        self.out = open(self.out_path, "wb")
        self.proc = subprocess.Popen(
            ["bash", "run_backend.sh"],
            cwd=ROOT,
            env=self.env,
            stdout=self.out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, as a terminal's foreground job
        )

    def said(self) -> str:
        return self.out_path.read_text(errors="replace")

    def ready(self) -> bool:
        """The launcher said it is ready (what a person waits for) and the dispatcher answers so."""
        assert self.proc.poll() is None, self.said()
        if "run_backend: ready: " not in self.said():
            return False
        try:
            return httpx.get(self.api + "/ready", timeout=2, verify=TLS).status_code == 200
        except httpx.HTTPError:
            return False

    def ctrl_c(self) -> None:
        """What a terminal does on Ctrl-C: SIGINT to every process of the foreground group."""
        os.killpg(self.proc.pid, signal.SIGINT)

    def running_track(self, job_id: str) -> bool:
        job = httpx.get(f"{self.api}/job/{job_id}", timeout=5, verify=TLS).json()
        return any(t["status"] not in ("queued", "done") for t in job["tracks"])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self.out.close()
        for pid in marked(self.mark):
            os.kill(pid, signal.SIGKILL)


def test_ctrl_c_says_what_it_waits_for_drains_once_and_leaves_no_file_on_the_worker(tmp_path):
    run = Launcher(tmp_path, delay="3")
    try:
        wait_for(run.ready, timeout=240, interval=0.5)
        job = httpx.post(
            run.api + "/generate", json={"lyrics": "la", "duration": 0.05, "num_tracks": 1}, verify=TLS
        ).json()
        wait_for(lambda: run.running_track(job["job_id"]), timeout=60, interval=0.1)
        run.ctrl_c()
        wait_for(lambda: PLAN in run.said(), timeout=10, interval=0.1)  # said at once, not after the drain
        assert run.proc.wait(timeout=120) == 0
        said = run.said()
        assert said.count("run_backend: stopping") == 1, said
        assert "stopping at once" not in said
        assert "run_backend: stopped 2 processes in " in said
        assert "==> " not in said  # the logs followed without tail's headers between the lines
        assert not marked(run.mark)
        api_log = (tmp_path / "logs" / "api.log").read_text()
        assert api_log.count("draining: waiting up to") == 1, api_log
        assert "drained: every running track finished and was collected" in api_log
        assert "not removed" not in api_log  # the worker was up for the dispatcher's delete
        # The take finished during the drain: copied to the results, and gone from the worker.
        assert list((tmp_path / "state" / "results" / job["job_id"]).glob("*.mp3")), api_log
        assert not [p.name for p in (tmp_path / "out").iterdir() if p.is_file()]
        worker_log = (tmp_path / "logs" / "worker_0.log").read_text()
        assert "draining: waiting" not in worker_log  # it had nothing left to run when it was stopped
    finally:
        run.close()


def test_a_second_ctrl_c_stops_at_once(tmp_path):
    run = Launcher(tmp_path, delay="300")  # a track that would hold a drain for its whole 30 s
    try:
        wait_for(run.ready, timeout=240, interval=0.5)
        job = httpx.post(
            run.api + "/generate", json={"lyrics": "la", "duration": 0.05, "num_tracks": 1}, verify=TLS
        ).json()
        wait_for(lambda: run.running_track(job["job_id"]), timeout=60, interval=0.1)
        run.ctrl_c()
        try:
            wait_for(lambda: PLAN in run.said(), timeout=10, interval=0.1)
        except TimeoutError:
            raise AssertionError(run.said()) from None
        run.ctrl_c()
        assert run.proc.wait(timeout=60) == 0
        said = run.said()
        assert "run_backend: stopping at once: unfinished tracks stay in the job store" in said, said
        assert "killing" not in said  # the second signal was enough
        assert not marked(run.mark)
        api_log = (tmp_path / "logs" / "api.log").read_text()
        assert "drained:" not in api_log  # it did not wait the drain out
    finally:
        run.close()


def test_ctrl_c_while_starting_stops_what_was_started_and_leaves_no_process(tmp_path):
    run = Launcher(tmp_path, delay="3")
    try:
        wait_for(lambda: "run_backend: starting worker 0" in run.said(), timeout=240, interval=0.05)
        run.ctrl_c()  # the worker is loading or the dispatcher starting: the launcher is not following yet
        assert run.proc.wait(timeout=60) == 130, run.said()
        said = run.said()
        assert "run_backend: stopped " in said, said
        assert "ready:" not in said
        assert not marked(run.mark)  # the launcher must not die at once and leave the worker running alone
    finally:
        run.close()
