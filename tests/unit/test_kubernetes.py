"""The Kubernetes manifests (``deploy/kubernetes``) against the Kubernetes API, the code and compose.yaml.

Both overlays render with ``kubectl kustomize``; every object validates strictly (no unknown field)
against the schemas of a pinned Kubernetes version (``kubernetes-validate``, its schemas bundled: no
network); every environment variable a container sets is one its program reads (pydantic-settings
ignores an unknown one silently: a renamed setting would leave the manifests setting nothing), and
the ones a cluster needs are set; the images, users and ports are the ones compose.yaml and the
Containerfiles give. The manifests run for real under ``podman kube play`` in CI
(``scripts/test-containers``, ``tests/process/kube_proof.py``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from pydantic_settings import BaseSettings

from songserve.api.settings import DispatcherSettings
from songserve.worker.settings import WorkerSettings
from tests.support.servers import ROOT

KUBE = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("cpu", "gpu")
KUBERNETES_VERSION = "1.32.0"  # the oldest of the versions the clusters we aim at run; the schemas are bundled
SECRET = "songserve-secrets"

Obj = dict[str, Any]


# ---- who reads what ---------------------------------------------------------------------------------
def settings_env(cls: type[BaseSettings]) -> set[str]:
    names = set()
    for name, field in cls.model_fields.items():
        alias = field.validation_alias
        names.add(alias if isinstance(alias, str) else name.upper())
    return names


def shell_reads(*paths: Path) -> set[str]:
    """``$NAME`` and ``${NAME…}`` in shell scripts (the images' entry point and health check)."""
    return {m for path in paths for m in re.findall(r"\$\{?([A-Z][A-Z0-9_]*)", path.read_text())}


def python_reads(*folders: Path) -> set[str]:
    read = re.compile(
        r"""os\.(?:environ\.get|getenv)\(\s*["']([A-Z][A-Z0-9_]*)["']|os\.environ\[\s*["']([A-Z][A-Z0-9_]*)["']\]"""
    )
    names = set()
    for folder in folders:
        for path in [folder] if folder.is_file() else folder.rglob("*.py"):
            names |= {a or b for a, b in read.findall(path.read_text())}
    return names


def readers() -> dict[str, set[str]]:
    """Each image (by name, as compose names it) → the variables its programs read."""
    images = shell_reads(ROOT / "deploy" / "entrypoint", ROOT / "deploy" / "healthcheck")
    common = images | python_reads(*(ROOT / "songserve").glob("*.py"))  # logging, the settings loader
    worker = settings_env(WorkerSettings) | common | python_reads(ROOT / "songserve" / "worker")
    # libpq reads PGPASSWORD (the password of STORE_URL's role), as docs/containers.md says.
    dispatcher = settings_env(DispatcherSettings) | common | python_reads(ROOT / "songserve" / "api") | {"PGPASSWORD"}
    postgres = shell_reads(ROOT / "deploy" / "postgres-entrypoint")
    return {
        "songserve-dispatcher": dispatcher,
        "songserve-worker": worker,
        "songserve-worker-gpu": worker,
        "songserve-postgres": postgres,
    }


READERS = readers()


# ---- compose's facts --------------------------------------------------------------------------------
def compose_default(value: str) -> str:
    """``${NAME:-default}`` read as compose does with NAME unset."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(value))


def compose_services(*files: str) -> dict[str, Obj]:
    services: dict[str, Obj] = {}
    for name in files:
        for service, body in yaml.safe_load((ROOT / name).read_text())["services"].items():
            services.setdefault(service, {}).update(body)
    return services


# ---- the manifests ----------------------------------------------------------------------------------
def kustomize(folder: Path) -> list[Obj]:
    done = subprocess.run(["kubectl", "kustomize", str(folder)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"kubectl kustomize {folder}: {done.stderr}"
    return [d for d in yaml.safe_load_all(done.stdout) if d]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Obj]]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed (Debian's kubernetes-client; bash scripts/packages tests installs it)")
    return {overlay: kustomize(KUBE / "overlays" / overlay) for overlay in OVERLAYS}


def pod_specs(objects: list[Obj]) -> Iterator[tuple[Obj, Obj]]:
    for obj in objects:
        if obj["kind"] in ("Deployment", "StatefulSet"):
            yield obj, obj["spec"]["template"]["spec"]


def containers(objects: list[Obj]) -> Iterator[tuple[Obj, Obj, Obj]]:
    for obj, spec in pod_specs(objects):
        for c in spec["containers"]:
            yield obj, spec, c


def image_name(image: str) -> str:
    """``registry/path/songserve-worker:tag`` → ``songserve-worker``."""
    return image.rsplit("/", 1)[-1].split(":", 1)[0]


def env_of(c: Obj) -> dict[str, Obj]:
    return {e["name"]: e for e in c.get("env", [])}


def one(objects: list[Obj], kind: str, name: str) -> Obj:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def unread_variables(objects: list[Obj]) -> list[str]:
    """Each variable a container sets that its image's programs do not read. A variable that only
    feeds another's value (``$(POD_IP)`` in PUBLIC_URL: Kubernetes expands it) counts as read."""
    unread = []
    for obj, _, c in containers(objects):
        known = READERS.get(image_name(c["image"]))
        assert known is not None, f"{obj['metadata']['name']}: no known image {c['image']}"
        env = env_of(c)
        values = " ".join(str(e.get("value", "")) for e in env.values())
        for name in env:
            if name not in known and f"$({name})" not in values:
                unread.append(
                    f"{obj['metadata']['name']}/{c['name']} sets {name}, which {image_name(c['image'])} does not read"
                )
        assert not c.get("envFrom"), "variables are listed one by one, so that this test sees each"
    return unread


# ---- the tests --------------------------------------------------------------------------------------
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_strictly_against_the_pinned_kubernetes(rendered, overlay):
    kinds = set()
    for obj in rendered[overlay]:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        kinds.add(obj["kind"])
    assert kinds >= {
        "Deployment",
        "StatefulSet",
        "Service",
        "PodDisruptionBudget",
        "PersistentVolumeClaim",
        "NetworkPolicy",
    }


def test_strict_validation_refuses_a_misspelt_field(rendered):
    (dispatcher,) = [
        o for o in rendered["cpu"] if o["metadata"]["name"] == "songserve-dispatcher" and o["kind"] == "Deployment"
    ]
    bad = yaml.safe_load(yaml.safe_dump(dispatcher))
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = bad["spec"]["template"]["spec"]["containers"][
        0
    ].pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_variable_the_manifests_set_is_read_by_the_program_it_reaches(rendered, overlay):
    assert unread_variables(rendered[overlay]) == []
    assert sum(len(c.get("env", [])) for _, _, c in containers(rendered[overlay])) >= 20


def test_a_variable_nobody_reads_fails_the_check(rendered, tmp_path):
    """The check above, on an overlay of the cpu one that sets a variable no program reads."""
    (tmp_path / "kustomization.yaml").write_text(
        f"bases:\n- {os.path.relpath(KUBE / 'overlays' / 'cpu', tmp_path)}\npatchesStrategicMerge:\n- typo.yaml\n"
    )
    (tmp_path / "typo.yaml").write_text(
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: songserve-dispatcher}\nspec:\n  template:\n"
        "    spec:\n      containers:\n      - name: dispatcher\n        env:\n"
        "        - {name: DRAIN_TIMEOUT_SECS, value: '60'}\n"
    )
    assert unread_variables(kustomize(tmp_path)) == [
        "songserve-dispatcher/dispatcher sets DRAIN_TIMEOUT_SECS, which songserve-dispatcher does not read"
    ]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_what_a_cluster_needs_is_set(rendered, overlay):
    objects = rendered[overlay]
    env = {image_name(c["image"]).removesuffix("-gpu"): env_of(c) for _, _, c in containers(objects)}
    secrets = {
        (name, e["valueFrom"]["secretKeyRef"]["key"])
        for image in env.values()
        for name, e in image.items()
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    example = (ROOT / "deploy" / "songserve.env.example").read_text()
    for name, key in secrets:
        assert name == key
        assert re.search(rf"^{key}=", example, re.M), f"{key}: not a key of songserve.env"
    assert {(n, k) for n, k in secrets} == {
        ("WORKER_TOKEN", "WORKER_TOKEN"),
        ("API_KEY", "API_KEY"),
        ("PGPASSWORD", "PGPASSWORD"),
    }
    d, w, pg = env["songserve-dispatcher"], env["songserve-worker"], env["songserve-postgres"]
    for needs, where in (({"WORKER_TOKEN", "API_KEY", "PGPASSWORD"}, d), ({"WORKER_TOKEN"}, w), ({"PGPASSWORD"}, pg)):
        assert needs <= where.keys(), f"{needs - where.keys()} unset"
    for secret_ref in [
        e["valueFrom"]["secretKeyRef"]
        for image in env.values()
        for e in image.values()
        if "valueFrom" in e and "secretKeyRef" in e["valueFrom"]
    ]:
        assert secret_ref["name"] == SECRET
    assert d["NUM_WORKERS"]["value"] == "0", "the workers announce themselves"
    assert d["API_HOST"]["value"] == w["HOST"]["value"] == "0.0.0.0"
    assert DispatcherSettings(store_url=d["STORE_URL"]["value"]).store_url.startswith("postgresql://")

    # The store's address is PostgreSQL's Service and port.
    store = re.fullmatch(r"postgresql://(\w+)@([\w-]+):(\d+)/(\w+)", d["STORE_URL"]["value"])
    assert store, d["STORE_URL"]["value"]
    pg_service = one(objects, "Service", store[2])
    assert (
        pg_service["spec"]["selector"]
        == one(objects, "StatefulSet", "songserve-postgres")["spec"]["template"]["metadata"]["labels"]
    )
    assert int(store[3]) == pg_service["spec"]["ports"][0]["port"] == int(pg["PGPORT"]["value"])

    # The workers announce to a Service of the dispatchers that lists them before they are ready (a
    # dispatcher is ready only once a worker is), at its port; and they give their pod's address.
    announce = re.fullmatch(r"http://([\w-]+):(\d+)", w["ANNOUNCE"]["value"])
    assert announce, w["ANNOUNCE"]["value"]
    service = one(objects, "Service", announce[1])
    assert service["spec"].get("publishNotReadyAddresses") is True
    dispatcher = one(objects, "Deployment", "songserve-dispatcher")
    assert service["spec"]["selector"] == dispatcher["spec"]["template"]["metadata"]["labels"]
    assert int(announce[2]) == service["spec"]["ports"][0]["port"]
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    assert w["PUBLIC_URL"]["value"] == f"http://$(POD_IP):{w['WORKER_PORT']['value']}"
    assert w["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_images_and_ports_are_composes(rendered, overlay):
    files = ("compose.yaml",) if overlay == "cpu" else ("compose.yaml", "compose.gpu.yaml")
    services = compose_services(*files)
    compose_images = {image_name(compose_default(s["image"])): compose_default(s["image"]) for s in services.values()}
    by_service = {"api1": "songserve-dispatcher", "worker0": "songserve-worker", "postgres": "songserve-postgres"}
    port_vars = ("API_PORT", "ACESTEP_PORT", "WORKER_PORT", "PGPORT")
    seen = set()
    for obj, _, c in containers(rendered[overlay]):
        name = image_name(c["image"])
        assert c["image"] == compose_images[name], (
            f"{obj['metadata']['name']}: {c['image']}, compose: {compose_images[name]}"
        )
        service = next(s for s, img in by_service.items() if name.startswith(img))
        compose_env = {k: compose_default(v) for k, v in services[service].get("environment", {}).items()}
        ports = {p["containerPort"] for p in c["ports"]}
        for var in port_vars:
            if var in env_of(c):
                value = env_of(c)[var]["value"]
                assert value == compose_env[var], f"{name} {var}={value}, compose: {compose_env[var]}"
                assert int(value) in ports, f"{name} listens on {var}={value} but declares ports {ports}"
        assert ports <= {int(compose_env[v]) for v in port_vars if v in compose_env}
        seen.add(name)
    want = {
        "songserve-dispatcher",
        "songserve-postgres",
        "songserve-worker" if overlay == "cpu" else "songserve-worker-gpu",
    }
    assert seen == want
    # Every Service targets a port its pods declare.
    for svc in [o for o in rendered[overlay] if o["kind"] == "Service"]:
        selected = [
            c
            for obj, _, c in containers(rendered[overlay])
            if svc["spec"]["selector"].items() <= obj["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert selected, f"Service {svc['metadata']['name']} selects no pod"
        for port in svc["spec"]["ports"]:
            assert any(port["targetPort"] in (p["name"], p["containerPort"]) for c in selected for p in c["ports"])


def image_uids() -> dict[str, int]:
    app = re.search(r"useradd .*--uid (\d+)", (ROOT / "Containerfile").read_text())
    pg = re.search(r"useradd .*--uid (\d+)", (ROOT / "deploy" / "postgres.Containerfile").read_text())
    assert app
    assert pg
    return {"songserve-dispatcher": int(app[1]), "songserve-worker": int(app[1]), "songserve-postgres": int(pg[1])}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_runs_as_its_images_user_read_only_with_no_capabilities(rendered, overlay):
    uids = image_uids()
    for obj, spec, c in containers(rendered[overlay]):
        pod, sc = spec["securityContext"], c["securityContext"]
        assert pod["runAsNonRoot"] is True
        assert pod["runAsUser"] == uids[image_name(c["image"]).removesuffix("-gpu")]
        assert sc["readOnlyRootFilesystem"] is True, obj["metadata"]["name"]
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"]
        assert not sc["capabilities"].get("add")
        mounted = {m["mountPath"] for m in c["volumeMounts"]}
        assert "/tmp" in mounted, f"{obj['metadata']['name']}: a read-only root needs a writable /tmp"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_grace_period_covers_the_drain(rendered, overlay):
    for obj, spec, c in containers(rendered[overlay]):
        env = env_of(c)
        if "DRAIN_TIMEOUT_SEC" not in env:
            continue
        pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", ["sleep", "0"])
        assert pre_stop[0] == "sleep"
        need = float(pre_stop[1]) + float(env["DRAIN_TIMEOUT_SEC"]["value"]) + 5  # 5 s: the process's own exit
        assert spec["terminationGracePeriodSeconds"] >= need, obj["metadata"]["name"]
    dispatcher = one(rendered[overlay], "Deployment", "songserve-dispatcher")
    assert dispatcher["spec"]["replicas"] >= 2
    assert dispatcher["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    c = dispatcher["spec"]["template"]["spec"]["containers"][0]
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert "preStop" in c["lifecycle"]
    pdb = one(rendered[overlay], "PodDisruptionBudget", "songserve-dispatcher")
    assert pdb["spec"]["selector"]["matchLabels"] == dispatcher["spec"]["selector"]["matchLabels"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_dispatchers_reach_workers_and_postgresql(rendered, overlay):
    objects = rendered[overlay]
    dispatcher_labels = one(objects, "Deployment", "songserve-dispatcher")["spec"]["template"]["metadata"]["labels"]
    guarded = {}
    for policy in [o for o in objects if o["kind"] == "NetworkPolicy"]:
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        (rule,) = policy["spec"]["ingress"]
        (source,) = rule["from"]
        assert source["podSelector"]["matchLabels"].items() <= dispatcher_labels.items()
        guarded[policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]] = rule["ports"]
    assert set(guarded) == {"worker", "postgres"}


def test_results_are_shared_and_the_gpu_release_read_only(rendered):
    for overlay in OVERLAYS:
        results = one(rendered[overlay], "PersistentVolumeClaim", "songserve-results")
        assert results["spec"]["accessModes"] == ["ReadWriteMany"]
    worker = one(rendered["gpu"], "Deployment", "songserve-worker")["spec"]["template"]["spec"]
    (c,) = worker["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    (release,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/checkpoints"]
    assert release["readOnly"] is True
    (volume,) = [v for v in worker["volumes"] if v["name"] == release["name"]]
    assert volume["persistentVolumeClaim"]["readOnly"] is True
    assert env_of(c)["CHECKPOINTS_DIR"]["value"] == "/checkpoints"
    cpu_worker = one(rendered["cpu"], "Deployment", "songserve-worker")["spec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in cpu_worker["resources"].get("limits", {})


def test_autoscaling_is_optional_and_reads_a_metric_the_dispatcher_exports(rendered):
    scaled = yaml.safe_load((KUBE / "optional" / "keda-scaledobject.yaml").read_text())
    assert scaled["kind"] == "ScaledObject"
    assert not any(o["kind"] == "ScaledObject" for objects in rendered.values() for o in objects)
    one(rendered["gpu"], "Deployment", scaled["spec"]["scaleTargetRef"]["name"])
    metrics = (ROOT / "songserve" / "api" / "metrics.py").read_text()
    (trigger,) = scaled["spec"]["triggers"]
    for metric in re.findall(r"\b(songserve_\w+)\{", trigger["metadata"]["query"]):
        assert f'"{metric}"' in metrics, f"{metric}: not a metric the dispatcher exports"
