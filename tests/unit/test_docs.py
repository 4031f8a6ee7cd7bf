"""The documentation keeps up with the code: the README stays a five-minute read whose commands are
the ones CI runs, every relative link resolves (to a file, and to a heading when it names one), and
every environment variable the code reads is documented in docs/configuration.md.

Where the code reads the environment: the settings classes (each field is an environment variable,
upper case, or its alias), ``os.environ``/``os.getenv`` reads, and the launcher's and scripts'
``${NAME:-…}`` / ``${NAME+…}`` reads.
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic_settings import BaseSettings

from songserve.api.settings import DispatcherSettings
from songserve.process.settings import CALLER_DIR_ENV
from songserve.worker.settings import WorkerSettings
from tests.support.servers import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE = [*sorted((ROOT / "songserve").rglob("*.py")), ROOT / "backend_api.py", ROOT / "backend_worker.py"]
SHELL = [ROOT / "run_backend.sh", *sorted((ROOT / "scripts").iterdir())]
PY_READ = re.compile(
    r"""os\.(?:environ\.get|getenv)\(\s*["']([A-Z][A-Z0-9_]*)["']|os\.environ\[\s*["']([A-Z][A-Z0-9_]*)["']\s*\](?!\s*=[^=])"""
)
SH_READ = re.compile(r"\$\{([A-Z][A-Z0-9_]*)(?::-|\+|-)")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def settings_env(cls: type[BaseSettings]) -> set[str]:
    names = set()
    for name, field in cls.model_fields.items():
        alias = field.validation_alias
        names.add(alias if isinstance(alias, str) else name.upper())
    return names


def env_reads() -> dict[str, str]:
    """Each environment variable the code reads → where (for the failure message)."""
    found: dict[str, str] = {CALLER_DIR_ENV: "songserve/process/settings.py caller_path"}  # read through a constant
    for cls in (WorkerSettings, DispatcherSettings):
        for name in settings_env(cls):
            found.setdefault(name, f"{cls.__module__} {cls.__name__}")
    for path in CODE:
        for m in PY_READ.finditer(path.read_text()):
            found.setdefault(m.group(1) or m.group(2), str(path.relative_to(ROOT)))
    for path in SHELL:
        for m in SH_READ.finditer(path.read_text()):
            found.setdefault(m.group(1), str(path.relative_to(ROOT)))
    return found


def test_every_environment_variable_the_code_reads_is_in_configuration_md():
    documented = (ROOT / "docs" / "configuration.md").read_text()
    reads = env_reads()
    assert {"API_KEYS_FILE", "SONGSERVE_URL", "BASE_MASTER_PORT", "WORKER_INDEX"} <= reads.keys()  # all kinds seen
    missing = {n: where for n, where in reads.items() if not re.search(rf"`[^`]*\b{n}\b[^`]*`", documented)}
    assert not missing, f"read by the code, not in docs/configuration.md: {missing}"


def test_the_check_finds_a_setting_that_is_not_documented():
    """The check above can fail: a field added to a settings class is seen."""

    class Extra(WorkerSettings):
        brand_new_knob: int = 0

    assert "BRAND_NEW_KNOB" in settings_env(Extra)
    assert "BRAND_NEW_KNOB" not in (ROOT / "docs" / "configuration.md").read_text()


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # a '#' in a code block is no heading
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, flags=re.M)}


def test_every_relative_link_resolves():
    broken = []
    for doc in DOCS:
        for target in LINK.findall(doc.read_text()):
            if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (doc.parent / file).resolve() if file else doc
            if not dest.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken


def test_the_readme_is_a_five_minute_read_and_runs_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    first_block = readme.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert first_block[0].startswith("bash run_backend.sh ")  # the one command a user runs
    # The test command, as .ci/run runs it, is named for contributors, apart from the user's start.
    assert re.search(r"\*\*Working on songserve itself:\*\* `bash scripts/test`", readme)
    assert "bash scripts/test" in (ROOT / ".ci" / "run").read_text()
    assert "(docs/containers.md)" in readme
    for name in ("WORKER_BASE_PORT", "API_PORT", "SONGSERVE_URL", "SONGSERVE_API_KEY"):
        assert name in readme, name
    assert (
        "BASE_MASTER_PORT" in (ROOT / "docs" / "configuration.md").read_text()
    )  # the detail, linked from "A port is busy?"
    assert "(docs/configuration.md#ports)" in readme
    assert "noise" in readme
