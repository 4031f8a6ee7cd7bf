"""The Kubernetes manifests' end-to-end proof: ``podman kube play`` of the cpu overlay, driven by
``bash scripts/test-containers`` after the compose proof (whose images, tagged ``ci``, it runs).

Why a script and not a pytest test: it needs the images built, podman and a minute of a shared
machine; CI runs it beside the suite. It renders ``deploy/kubernetes/overlays/cpu`` with ``kubectl
kustomize``, applies the proof-only patch below (``for_podman``), plays the result, and checks through
real HTTP:

1. PostgreSQL, two dispatchers and a worker start from the manifests; the worker announces itself and
   both dispatchers become ready;
2. a two-take song is made through the dispatcher that leases the worker, and both serve its files;
3. that dispatcher's pod is killed (``podman pod kill``: SIGKILL, no drain) while a second job's track
   runs on the worker it leases, and that job completes through the other dispatcher, once: its
   track's files are in the shared results volume one time, with no copy left half-made;
4. after ``podman kube down`` and the removal of the volumes and the secret it made, no pod,
   container, volume or secret of the proof is left.

The proof-only patch, what podman (4.3, Debian 12's) cannot do as a cluster does, said once here and
in docs/kubernetes.md:

- Services are skipped by podman and it has no cluster DNS: every pod runs on the host's network
  (``hostNetwork``, so the containers' ``ports``, which podman would publish, are dropped), each
  program listening on 127.0.0.1 on a port picked here; a Service's name in a
  variable becomes 127.0.0.1 and that port: STORE_URL's ``songserve-postgres``, and ANNOUNCE's
  ``songserve-dispatchers``, which becomes both dispatchers' addresses (what the Service spreads the
  announcements over). PUBLIC_URL is the worker's loopback address instead of its pod's (POD_IP).
- podman runs one replica of a Deployment: the dispatchers' Deployment of two becomes two Deployments
  of one (``-a``, ``-b``), on ports of their own.
- podman has no StatefulSet: PostgreSQL's becomes a Deployment of one, its volumeClaimTemplate a
  PersistentVolumeClaim (a podman volume).
- podman 4.3 makes one volume of all emptyDirs of one name, shared by every pod that has one (the two
  dispatchers' ``state``): each emptyDir becomes a PersistentVolumeClaim of its pod's own (a podman
  volume, removed at the end).
- The Secret songserve-secrets is a podman secret (where podman 4.3's secretKeyRef looks: a JSON
  object of base64 values), with random values.
- The images are the compose proof's (tag ``ci``); the worker mounts the host's tiny set read-only at
  /checkpoints (hostPath), as the compose proof's worker does, instead of building it at its start.
- PodDisruptionBudget and NetworkPolicy are dropped (nothing in podman acts on them); every pod gets
  the label ``songserve.ci/proof: kube``, by which leftovers are found.

Environment (set by the script): OUT (a scratch folder), TAG (the images' tag), CHECKPOINTS (the host's
tiny set).
"""

from __future__ import annotations

import base64
import copy
import json
import os
import random
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.support.http import TLS

ROOT = Path(__file__).resolve().parents[2]
OVERLAY = ROOT / "deploy" / "kubernetes" / "overlays" / "cpu"
PROOF_LABEL = "songserve.ci/proof"
TERMINAL = {"completed", "partial", "failed", "cancelled"}
RUNNING = {"generating", "superres", "decoding"}
SONG = {"lyrics": "[verse]\nthe cluster sings\n", "tags": "pop", "duration": 0.05, "num_tracks": 2, "seed": 4343}
LONG = {"lyrics": "[verse]\none pod falls, the other sings\n", "duration": 0.25, "num_tracks": 1, "seed": 78}

Obj = dict[str, Any]


def say(msg: str) -> None:
    print(f"test-containers: kube: {msg}", flush=True)


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


def podman(*args: str, check: bool = True) -> str:
    done = subprocess.run(["podman", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout.strip()


def free_ports(n: int) -> list[int]:
    """From 10000-10999: below the kernel's ephemeral range and the suite's own (tests/support/servers.py
    picks from 11000 up), as scripts/test-containers picks the compose proof's."""
    picked: list[int] = []
    held = []
    for port in random.sample(range(10000, 11000), 300):
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            s.close()
            continue
        held.append(s)
        picked.append(port)
        if len(picked) == n:
            break
    for s in held:
        s.close()
    return picked


# ---- the manifests, and the proof-only patch --------------------------------------------------------
def render() -> list[Obj]:
    done = subprocess.run(["kubectl", "kustomize", str(OVERLAY)], capture_output=True, text=True, check=True)
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def env_set(container: Obj, name: str, value: str) -> None:
    env = container.setdefault("env", [])
    for e in env:
        if e["name"] == name:
            e.clear()
            e.update(name=name, value=value)
            return
    env.append({"name": name, "value": value})


def env_drop(container: Obj, name: str) -> None:
    container["env"] = [e for e in container.get("env", []) if e["name"] != name]


def pvc(name: str, size: str = "1Gi") -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": name, "labels": {PROOF_LABEL: "kube"}},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": size}}},
    }


def for_podman(objects: list[Obj], ports: dict[str, int], tag: str, checkpoints: str) -> list[Obj]:
    """The rendered overlay as podman kube play can run it on loopback (the module's docstring lists
    each change and why)."""
    by = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    out: list[Obj] = [o for o in objects if o["kind"] == "PersistentVolumeClaim"]
    for o in out:
        o["metadata"].setdefault("labels", {})[PROOF_LABEL] = "kube"
    dispatchers = f"http://127.0.0.1:{ports['api_a']},http://127.0.0.1:{ports['api_b']}"

    def pod_of(workload: Obj, name: str) -> Obj:
        """A Deployment of one replica, on the host's network, emptyDirs as volumes of its own."""
        d = copy.deepcopy(workload)
        d["kind"], d["metadata"]["name"] = "Deployment", name
        d["spec"] = {k: v for k, v in d["spec"].items() if k not in ("serviceName", "volumeClaimTemplates")}
        d["spec"]["replicas"] = 1
        template = d["spec"]["template"]
        template["metadata"]["labels"][PROOF_LABEL] = "kube"
        spec = template["spec"]
        spec["hostNetwork"] = True
        for volume in spec.get("volumes", []):
            if "emptyDir" in volume:
                claim = f"{name}-{volume['name']}"
                del volume["emptyDir"]
                volume["persistentVolumeClaim"] = {"claimName": claim}
                out.append(pvc(claim))
        for c in spec["containers"]:
            repo = c["image"].rsplit(":", 1)[0]
            c["image"] = f"{repo}:{tag}"
            c.pop("ports", None)  # podman would publish them, which the host's network refuses
        out.append(d)
        return d

    postgres_set = by[("StatefulSet", "songserve-postgres")]
    postgres = pod_of(postgres_set, "songserve-postgres")
    for template in postgres_set["spec"]["volumeClaimTemplates"]:
        claim = f"{template['metadata']['name']}-songserve-postgres-0"  # the StatefulSet's claim name
        out.append(pvc(claim))
        postgres["spec"]["template"]["spec"].setdefault("volumes", []).append(
            {"name": template["metadata"]["name"], "persistentVolumeClaim": {"claimName": claim}}
        )
    (c,) = postgres["spec"]["template"]["spec"]["containers"]
    env_set(c, "PGPORT", str(ports["pg"]))
    env_set(c, "LISTEN_ADDRESSES", "127.0.0.1")

    for side in ("a", "b"):
        d = pod_of(by[("Deployment", "songserve-dispatcher")], f"songserve-dispatcher-{side}")
        d["spec"]["template"]["metadata"]["labels"]["songserve.ci/dispatcher"] = side
        d["spec"]["selector"]["matchLabels"]["songserve.ci/dispatcher"] = side
        (c,) = d["spec"]["template"]["spec"]["containers"]
        env_set(c, "API_HOST", "127.0.0.1")
        env_set(c, "API_PORT", str(ports[f"api_{side}"]))
        env_set(c, "ACESTEP_PORT", str(ports[f"acestep_{side}"]))
        env_set(c, "STORE_URL", f"postgresql://songserve@127.0.0.1:{ports['pg']}/songserve")
        env_set(c, "DISPATCHER_ID", f"dispatcher-{side}")

    worker = pod_of(by[("Deployment", "songserve-worker")], "songserve-worker")
    (c,) = worker["spec"]["template"]["spec"]["containers"]
    env_drop(c, "POD_IP")
    env_set(c, "HOST", "127.0.0.1")
    env_set(c, "WORKER_PORT", str(ports["worker"]))
    env_set(c, "ANNOUNCE", dispatchers)
    env_set(c, "PUBLIC_URL", f"http://127.0.0.1:{ports['worker']}")
    c["volumeMounts"].append({"name": "checkpoints", "mountPath": "/checkpoints", "readOnly": True})
    worker["spec"]["template"]["spec"]["volumes"].append(
        {"name": "checkpoints", "hostPath": {"path": checkpoints, "type": "Directory"}}
    )
    return out


def secret_json(values: dict[str, str]) -> str:
    """songserve-secrets as podman 4.3's kube play reads a secretKeyRef: a podman secret holding a JSON
    object of base64 values (a Secret's ``data``)."""
    return json.dumps({k: base64.b64encode(v.encode()).decode() for k, v in values.items()})


# ---- the run ----------------------------------------------------------------------------------------
class Api:
    def __init__(self, name: str, port: int, key: str) -> None:
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        self.http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {key}"}, timeout=30, verify=TLS)

    def ready(self) -> bool:
        return self.http.get("/ready").status_code == 200

    def status(self) -> dict[str, Any]:
        r = self.http.get("/status")
        r.raise_for_status()
        return dict(r.json())

    def submit(self, body: dict[str, Any]) -> str:
        r = self.http.post("/generate", json=body)
        assert r.status_code in (200, 201, 202), f"POST /generate at {self.name}: {r.status_code} {r.text}"
        return str(r.json()["job_id"])

    def job(self, job_id: str) -> dict[str, Any]:
        r = self.http.get(f"/job/{job_id}")
        r.raise_for_status()
        return dict(r.json())

    def done(self, job_id: str, timeout: float) -> dict[str, Any]:
        job = wait_for(
            f"job {job_id} at {self.name}", lambda: (j := self.job(job_id))["status"] in TERMINAL and j, timeout
        )
        assert job["status"] == "completed", f"job {job_id}: {json.dumps(job)[:2000]}"
        return dict(job)

    def files(self, job_id: str, n: int) -> None:
        for i in range(n):
            for kind in ("wav", "mp3"):
                r = self.http.get(f"/job/{job_id}/track/{i}/{kind}")
                assert r.status_code == 200, f"{self.name} track {i} {kind}: {r.status_code} {r.text[:300]}"
                assert len(r.content) > 1000, f"{self.name} track {i} {kind}: {len(r.content)} bytes"

    def holders(self) -> set[str | None]:
        return {w.get("leased_by") for w in self.status()["workers"]}


def pod_id(deployment: str) -> str:
    ids = podman("pod", "ps", "-q", "--filter", f"label={PROOF_LABEL}=kube", "--filter", f"name=^{deployment}-pod")
    assert len(ids.split()) == 1, f"pods of {deployment}: {ids!r}"
    return ids


def main() -> int:
    out = Path(os.environ["OUT"])
    tag, checkpoints = os.environ.get("TAG", "ci"), os.environ["CHECKPOINTS"]
    names = ("pg", "api_a", "api_b", "acestep_a", "acestep_b", "worker")
    ports = dict(zip(names, free_ports(len(names)), strict=True))
    values = {k: f"ci-{k.lower()}-{secrets.token_hex(8)}" for k in ("WORKER_TOKEN", "API_KEY", "PGPASSWORD")}

    t0 = time.monotonic()
    manifests = out / "kube.yaml"
    manifests.write_text(yaml.safe_dump_all(for_podman(render(), ports, tag, checkpoints), sort_keys=False))
    (out / "secret.json").write_text(secret_json(values))
    podman("secret", "create", "songserve-secrets", str(out / "secret.json"))
    (out / "secret.json").unlink()
    podman("kube", "play", str(manifests))
    a = Api("dispatcher-a", ports["api_a"], values["API_KEY"])
    b = Api("dispatcher-b", ports["api_b"], values["API_KEY"])
    for api in (a, b):
        wait_for(f"{api.name}'s /ready", api.ready, 240)
        wait_for(f"the worker announced to {api.name} and idle", lambda x=api: x.status()["idle_gpus"] >= 1, 240)
    say(f"PostgreSQL, two dispatchers and a worker up and ready in {time.monotonic() - t0:.1f}s")

    # The one worker is leased to one dispatcher (each one's fair share is one, and one that holds it
    # keeps it): the song and the job whose dispatcher is killed go through that one, so the kill hits
    # the dispatcher running the track.
    holder = wait_for("the worker's lease", lambda: (h := a.holders()) <= {"dispatcher-a", "dispatcher-b"} and h, 60)
    first, other = (a, b) if holder == {"dispatcher-a"} else (b, a)
    song = first.submit(SONG)
    first.done(song, timeout=300)
    for api in (first, other):  # the shared results volume
        api.files(song, SONG["num_tracks"])
    say(f"two-take song {song} made through {first.name}, its files served by both")

    job = first.submit(LONG)
    wait_for(f"job {job}'s track running", lambda: first.job(job)["tracks"][0]["status"] in RUNNING, 120, 0.1)
    assert other.holders() == {first.name}, f"the worker's lease moved: {other.holders()}"
    podman("pod", "kill", pod_id(f"songserve-{first.name}"))
    say(f"killed {first.name}'s pod (SIGKILL) while job {job} ran on the worker it leases")
    finished = other.done(job, timeout=300)
    other.files(job, LONG["num_tracks"])
    results = Path(podman("volume", "inspect", "-f", "{{.Mountpoint}}", "songserve-results")) / job
    files = sorted(p.name for p in results.iterdir())
    assert [f for f in files if f.startswith("track_0.")] == files, f"more than track 0's files: {files}"
    assert {"track_0.wav", "track_0.mp3"} <= set(files), files
    attempts = [t["attempts"] for t in finished["tracks"]]
    say(f"job {job} completed through {other.name}, once (attempts {attempts}; its files: {', '.join(files)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
