"""The container files against the code: a setting renamed or removed must not leave compose.yaml or
the Containerfile setting a variable nobody reads (pydantic-settings ignores unknown ones silently).

The deployment itself is proven with real podman by ``bash scripts/test-containers`` (CI runs it).
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from songserve.api.settings import DispatcherSettings
from songserve.worker.settings import WorkerSettings

ROOT = Path(__file__).resolve().parents[2]

# Read by the entry point, libpq or the launcher's conventions rather than by a settings class.
NOT_SETTINGS = {
    "SONGSERVE_ROLE",
    "WORKER_INDEX",
    "PGPASSWORD",
    "HEALTHCHECK_KEY",
    "STORE_WAIT_SEC",
    "PYTHONUNBUFFERED",
    "PYTHONDONTWRITEBYTECODE",
}


def env_names(cls: type) -> set[str]:
    names = set()
    for name, field in cls.model_fields.items():  # type: ignore[attr-defined]
        alias = field.validation_alias
        names.add((alias if isinstance(alias, str) else name).upper())
    return names


DISPATCHER, WORKER = env_names(DispatcherSettings), env_names(WorkerSettings)


def compose_services() -> dict[str, dict]:
    services: dict[str, dict] = {}
    for name in ("compose.yaml", "compose.gpu.yaml"):
        for service, body in yaml.safe_load((ROOT / name).read_text())["services"].items():
            services.setdefault(service, {}).update(body)
    return services


def test_every_variable_compose_sets_is_a_setting_of_the_program_it_reaches():
    services = compose_services()
    checked = 0
    for service, body in services.items():
        known = DISPATCHER if service.startswith("api") else WORKER if service.startswith("worker") else None
        if known is None:
            continue
        for var in body.get("environment", {}):
            assert var in known | NOT_SETTINGS, f"{service} sets {var}, which its program does not read"
            checked += 1
    assert checked >= 15


def test_every_variable_the_images_set_is_a_setting():
    text = (ROOT / "Containerfile").read_text()
    stages = re.split(r"^FROM ", text, flags=re.M)
    for stage in stages:
        target = stage.split()[2] if len(stage.split()) > 2 and stage.split()[1] == "AS" else ""
        known = {"dispatcher": DISPATCHER, "worker": WORKER}.get(target)
        if known is None:
            continue
        env = " ".join(re.findall(r"^ENV (.*(?:\\\n.*)*)", stage, flags=re.M)).replace("\\\n", " ")
        names = re.findall(r"([A-Z_]+)=", env)
        assert names, f"stage {target} sets no ENV"
        for name in names:
            assert name in known | NOT_SETTINGS, f"the {target} image sets {name}, which its program does not read"


def test_the_env_example_names_settings_both_programs_or_libpq_read():
    lines = (ROOT / "deploy" / "songserve.env.example").read_text().splitlines()
    names = [line.split("=", 1)[0] for line in lines if line and not line.startswith("#")]
    assert set(names) == {"WORKER_TOKEN", "API_KEY", "PGPASSWORD"}
    assert "WORKER_TOKEN" in DISPATCHER & WORKER
    assert "API_KEY" in DISPATCHER


def test_the_build_context_holds_no_checkpoints_state_or_secrets():
    allowed = {line[1:] for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")}
    assert "*" in (ROOT / ".dockerignore").read_text().splitlines()  # everything else is left out
    assert allowed == {
        "backend_api.py",
        "backend_worker.py",
        "songserve",
        "deploy",
        "requirements.txt",
        "requirements.lock",
        "wheelhouse",
    }
    assert not list((ROOT / "deploy").glob("*.env")), "a filled-in env file must not sit in the build context"
