"""The container deployment's end-to-end proof, driven by ``bash scripts/test-containers``.

Why a script and not a pytest test: it needs the images built, podman and minutes of a shared
machine; CI runs it once after the suite. It drives compose.yaml as a user would (the compose
command comes from the environment) and checks, through real HTTP:

1. a two-take song made through the first dispatcher (api1);
2. a second job whose track is running when api1's container is killed (``podman kill``, no drain)
   completes through the second dispatcher (api2);
3. the stack taken down and brought up again (volumes kept) still serves both jobs, with the same bytes;
4. the two-take song's WAV and MP3 files equal, byte for byte, what ``run_backend.sh`` on the host gives
   for the same request and seeds (the host's tiny checkpoint set, mounted read-only into the worker);
5. after ``down -v`` no container, pod or volume of the project is left.

Environment (set by the script): COMPOSE (the compose command line, project and files included),
PROJECT, API_PORT, API2_PORT, API_KEY, HOST_API_PORT, HOST_WORKER_PORT, OUT (a scratch folder).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from tests.support.http import TLS

ROOT = Path(__file__).resolve().parents[2]
TERMINAL = {"completed", "partial", "failed", "cancelled"}
RUNNING = {"generating", "superres", "decoding"}
SONG = {"lyrics": "[verse]\ncontainers hold the song\n", "tags": "pop", "duration": 0.05, "num_tracks": 2, "seed": 4242}
LONG = {"lyrics": "[verse]\nthe first one falls, the second sings\n", "duration": 0.25, "num_tracks": 1, "seed": 77}


def say(msg: str) -> None:
    print(f"test-containers: {msg}", flush=True)


def wait_for(what: str, probe: Callable[[], Any], timeout: float, interval: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            got = probe()
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            got, last = None, exc
        if got:
            return got
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last error: {last!r})")


class Api:
    def __init__(self, port: int, key: str = "") -> None:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.url = f"http://127.0.0.1:{port}"
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=30, verify=TLS)

    def ready(self) -> bool:
        return self.http.get("/ready").status_code == 200

    def status(self) -> dict[str, Any]:
        r = self.http.get("/status")
        r.raise_for_status()
        return dict(r.json())

    def submit(self, body: dict[str, Any]) -> str:
        r = self.http.post("/generate", json=body)
        assert r.status_code in (200, 201, 202), f"POST /generate at {self.url}: {r.status_code} {r.text}"
        return str(r.json()["job_id"])

    def job(self, job_id: str) -> dict[str, Any]:
        r = self.http.get(f"/job/{job_id}")
        r.raise_for_status()
        return dict(r.json())

    def done(self, job_id: str, timeout: float) -> dict[str, Any]:
        job = wait_for(
            f"job {job_id} at {self.url}", lambda: (j := self.job(job_id))["status"] in TERMINAL and j, timeout
        )
        assert job["status"] == "completed", f"job {job_id}: {json.dumps(job)[:2000]}"
        return dict(job)

    def files(self, job_id: str, n: int) -> dict[str, bytes]:
        out = {}
        for i in range(n):
            for kind in ("wav", "mp3"):
                r = self.http.get(f"/job/{job_id}/track/{i}/{kind}")
                assert r.status_code == 200, f"{self.url} track {i} {kind}: {r.status_code} {r.text[:300]}"
                out[f"take{i}.{kind}"] = r.content
        return out


def compose(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = [*shlex.split(os.environ["COMPOSE"]), *args]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise AssertionError(
            f"{shlex.join(cmd)} failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )
    return done


def podman(*args: str) -> str:
    return subprocess.run(["podman", *args], capture_output=True, text=True, check=True).stdout.strip()


def project_containers(service: str = "") -> list[str]:
    filters = ["--filter", f"label=io.podman.compose.project={os.environ['PROJECT']}"]
    if service:
        filters += ["--filter", f"label=com.docker.compose.service={service}"]
    return podman("ps", "-aq", *filters).split()


def fleet_up(api1: Api, api2: Api, timeout: float) -> None:
    """Both dispatchers ready, and the worker announced to them and idle; then each image's own health
    check passes (run by hand: podman's timers for it need systemd, which CI machines lack)."""
    for api in (api1, api2):
        wait_for(f"{api.url}/ready", api.ready, timeout)
        wait_for(f"an idle worker at {api.url}", lambda a=api: a.status()["idle_gpus"] >= 1, timeout)
    for service in ("postgres", "api1", "api2", "worker0"):
        (cid,) = project_containers(service)
        done = subprocess.run(["podman", "healthcheck", "run", cid], capture_output=True, text=True)
        assert done.returncode == 0, f"{service}'s HEALTHCHECK: {done.stdout}{done.stderr}"


def holders(api: Api) -> set[str | None]:
    return {w.get("leased_by") for w in api.status()["workers"]}


def lease_to_api1(api1: Api, api2: Api) -> None:
    """Either dispatcher may have leased the one worker; the kill must hit the one running the track.
    A stopped dispatcher (SIGTERM: it drains) gives its leases back, and one that comes back does not
    take a lease its peer holds (each one's fair share of one worker is one)."""
    if holders(api1) == {"api1"}:
        return
    (api2_id,) = project_containers("api2")
    podman("stop", "-t", "40", api2_id)
    wait_for("api1 to lease the worker api2 gave back", lambda: holders(api1) == {"api1"}, 60)
    podman("start", api2_id)
    wait_for(f"{api2.url}/ready", api2.ready, 120)
    say("api2 was stopped (it drains and gives its lease back) and started again: api1 leases the worker")


def host_reference(out: Path) -> dict[str, bytes]:
    """The same song from run_backend.sh on this host (the tiny set, as in the container)."""
    env = {
        **os.environ,
        "API_PORT": os.environ["HOST_API_PORT"],
        "WORKER_BASE_PORT": os.environ["HOST_WORKER_PORT"],
        "BASE_MASTER_PORT": "0",
        "LOG_DIR": str(out / "host-logs"),
        "STATE_DIR": str(out / "host-state"),
        "WORKER_TOKEN": "host-reference-token",
    }
    for name in ("API_KEY", "STORE_URL", "CHECKPOINTS_DIR", "ACESTEP_PORT"):
        env.pop(name, None)
    launcher = ["bash", str(ROOT / "run_backend.sh")]
    started = subprocess.run([*launcher, "--no-follow"], env=env, capture_output=True, text=True)
    try:
        assert started.returncode == 0, f"run_backend.sh failed:\n{started.stdout}{started.stderr}"
        host = Api(int(env["API_PORT"]))
        job_id = host.submit(SONG)
        host.done(job_id, timeout=300)
        return host.files(job_id, SONG["num_tracks"])
    finally:
        subprocess.run([*launcher, "stop"], env=env, capture_output=True, text=True)


def main() -> int:
    out = Path(os.environ["OUT"])
    key = os.environ["API_KEY"]
    api1, api2 = Api(int(os.environ["API_PORT"]), key), Api(int(os.environ["API2_PORT"]), key)
    reference: dict[str, bytes] = {}
    failed: list[BaseException] = []

    def make_reference() -> None:
        try:
            reference.update(host_reference(out))
        except BaseException as exc:  # reported by the main thread
            failed.append(exc)

    t0 = time.monotonic()
    compose("up", "-d")
    fleet_up(api1, api2, timeout=240)
    say(f"the composition is up and ready in {time.monotonic() - t0:.1f}s")
    host = threading.Thread(target=make_reference, name="host-reference")
    host.start()  # the same song from the host's launcher, meanwhile; compared at the end

    song = api1.submit(SONG)
    first = api1.done(song, timeout=300)
    song_files = api1.files(song, SONG["num_tracks"])
    say(f"two-take song {song} made through api1: seeds {[t['seed'] for t in first['tracks']]}")

    lease_to_api1(api1, api2)
    long_job = api1.submit(LONG)
    wait_for(f"job {long_job}'s track running", lambda: api1.job(long_job)["tracks"][0]["status"] in RUNNING, 120, 0.1)
    assert holders(api2) == {"api1"}, f"the worker's lease moved: {holders(api2)}"
    (api1_id,) = project_containers("api1")
    podman("kill", api1_id)
    say(f"killed api1's container (SIGKILL) while job {long_job} ran on the worker it leases")
    after_kill = api2.done(long_job, timeout=300)
    state = podman("inspect", "-f", "{{.State.Status}}, restarted {{.RestartCount}} times", api1_id)
    attempts = [t["attempts"] for t in after_kill["tracks"]]
    say(f"job {long_job} completed through api2 (attempts {attempts}); api1's container: {state}")

    compose("down")
    compose("up", "-d")
    fleet_up(api1, api2, timeout=240)
    for api in (api1, api2):
        for job_id, n in ((song, SONG["num_tracks"]), (long_job, LONG["num_tracks"])):
            assert api.job(job_id)["status"] == "completed", f"{job_id} at {api.url} after the restart"
            api.files(job_id, n)
    assert api2.files(song, SONG["num_tracks"]) == song_files, "the song's files changed across the restart"
    say("after down and up: both jobs read back from api1 and api2, the song's files unchanged")

    host.join()
    if failed:
        raise failed[0]
    for name, data in sorted(song_files.items()):
        assert reference[name] == data, (
            f"{name}: {len(data)} bytes from the containers, {len(reference[name])} from the host"
        )
    say(f"the song's {len(song_files)} files equal run_backend.sh's on the host, byte for byte")
    return 0


if __name__ == "__main__":
    sys.exit(main())
