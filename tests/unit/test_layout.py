"""The package's shape: no import cycles, a docstring each, the walls between the rooms, and rooms, not loose modules.

Modules are sized by the concept they hold, not by a line count: no cap is checked here.

Imports are read from the source (every ``import``/``from … import`` of a ``songserve`` module,
at module level, inside functions and under ``TYPE_CHECKING`` alike): a cycle hidden behind a lazy
import is still a cycle for a reader.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "songserve"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(name: str) -> str | None:
    """The project module an import names (a submodule if it exists, else its package)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for name in names:
            if name == "songserve" or name.startswith("songserve."):
                target = _resolve(name)
                if target and target != module and not module.startswith(target + "."):
                    out.add(target)  # a module importing its own package's __init__ is not an edge
    return out


def _graph() -> dict[str, set[str]]:
    return {m: _imports(m, p) for m, p in MODULES.items()}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    WHITE, GREY, BLACK = 0, 1, 2
    colour = dict.fromkeys(graph, WHITE)
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        colour[node] = GREY
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if colour.get(nxt, BLACK) == GREY:
                return [*stack[stack.index(nxt) :], nxt]
            if colour.get(nxt) == WHITE:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        colour[node] = BLACK
        return None

    for node in sorted(graph):
        if colour[node] == WHITE:
            found = visit(node)
            if found:
                return found
    return None


def test_the_package_has_no_import_cycles():
    cycle = _find_cycle(_graph())
    assert cycle is None, "import cycle: " + " → ".join(cycle or [])


def test_every_module_and_package_has_a_docstring():
    missing = [m for m, p in MODULES.items() if not ast.get_docstring(ast.parse(p.read_text(encoding="utf-8")))]
    assert missing == []


# The walls between the dispatcher's rooms (docs/architecture.md, "Layers"): an import from a module
# under the first prefix of anything under the second is an arrow that must never exist.
API = "songserve.api"
CLI_MAY_IMPORT = ("songserve.schemas", "songserve.http.keepalive")
ROOMS = [
    f"{API}.{r}"
    for r in ("jobs", "http", "service", "dispatch", "workers", "results", "webhooks", "store", "acestep", "mcp")
]
WALLS: list[tuple[str, tuple[str, ...], str]] = [
    (f"{API}.store", (f"{API}.dispatch", f"{API}.service", f"{API}.http", f"{API}.webhooks"),
     "the store keeps records; it never calls the parts that change them"),
    (f"{API}.store.sqlite", (f"{API}.store.postgres",), "the engines share store/ itself, never each other"),
    (f"{API}.store.postgres", (f"{API}.store.sqlite",), "the engines share store/ itself, never each other"),
    (f"{API}.dispatch", (f"{API}.service", f"{API}.http"), "the dispatcher is called by the service, never the reverse"),
    (f"{API}.workers", (f"{API}.dispatch", f"{API}.store", f"{API}.results"),
     "the worker client speaks to workers and knows nothing of what the dispatcher does with answers"),
    (f"{API}.webhooks", (f"{API}.dispatch", f"{API}.service"), "webhooks read the outbox, not the dispatcher"),
    (f"{API}.results", (f"{API}.dispatch",), "results are files; the dispatcher decides when to keep them"),
    (f"{API}.mcp", (f"{API}.store", f"{API}.dispatch", f"{API}.http", f"{API}.workers", f"{API}.results", f"{API}.webhooks"),
     "the MCP server is a client of the service, as the HTTP routes are"),
    (f"{API}.jobs", tuple(r for r in ROOMS if r != f"{API}.jobs") + (f"{API}.settings", f"{API}.metrics"),
     "the records import no other room"),
    (API, ("songserve.worker", "songserve.pipeline"), "the dispatcher never runs a model: workers do"),
    ("songserve.worker", (API,), "a worker knows no dispatcher's code, only the contract"),
    (f"{API}.settings", (f"{API}.",), "settings are read by the features, never the reverse"),
    ("songserve.worker.settings", ("songserve.worker.", "songserve.pipeline."),
     "settings are read by the features, never the reverse"),
    ("songserve.process", ("songserve.api", "songserve.worker", "songserve.pipeline", "songserve.cli"),
     "the shared loader and logging are below every program"),
    # The package's own rooms (docs/architecture.md, "Rooms").
    ("songserve.worker", ("songserve.cli",), "a worker is a server; the command line is a client of servers"),
    ("songserve.pipeline", ("songserve.http", "songserve.worker", "songserve.cli", "songserve.process.settings"),
     "the pipeline runs on a worker's model thread: it knows no HTTP and reads its settings through config.py"),
    ("songserve.http", ("songserve.api", "songserve.worker", "songserve.pipeline", "songserve.cli", "songserve.audio",
                        "songserve.process"),
     "the shared HTTP plumbing knows no service that uses it"),
    ("songserve.audio", ("songserve.api", "songserve.worker", "songserve.pipeline", "songserve.http", "songserve.cli",
                         "songserve.process"),
     "the audio files are read the same way by every service: they depend on none"),
    ("songserve.schemas", ("songserve.api", "songserve.worker", "songserve.pipeline", "songserve.http", "songserve.cli",
                           "songserve.process"),
     "the contract is below both services"),
    ("songserve.cli", tuple(m for m in MODULES if not any(  # all but these, and the packages above them
        m == a or m.startswith(a + ".") or a.startswith(m + ".") for a in ("songserve.cli", *CLI_MAY_IMPORT))),
     "the command line imports only the contract and the HTTP client's settings"),
]  # fmt: skip
# What a wall allows inside a room it forbids: one arrow, with its reason.
ALLOWED = {
    ("songserve.worker.settings", "songserve.worker.urls"): "the URL rules are pure string work the settings check",
}


def _under(module: str, prefix: str) -> bool:
    return module == prefix.rstrip(".") or module.startswith(prefix if prefix.endswith(".") else prefix + ".")


def _broken_walls(graph: dict[str, set[str]]) -> list[str]:
    broken = []
    for module, targets in sorted(graph.items()):
        for source, forbidden, why in WALLS:
            if not _under(module, source):
                continue
            for target in sorted(targets):
                if (module, target) in ALLOWED:
                    continue
                if any(_under(target, f) for f in forbidden) and not _under(target, source):
                    broken.append(f"{module} → {target}: {why}")
    return broken


def test_the_rooms_keep_their_walls():
    assert _broken_walls(_graph()) == []


@pytest.mark.parametrize(
    ("room", "imported", "why"),
    [
        (
            "songserve.api.store",
            "songserve.api.dispatch.dispatcher",
            "the store keeps records; it never calls the parts that change them",
        ),
        (
            "songserve.worker",
            "songserve.api.dispatch.dispatcher",
            "a worker knows no dispatcher's code, only the contract",
        ),
        (
            "songserve.pipeline.stages",
            "songserve.http.errors",
            "the pipeline runs on a worker's model thread: it knows no HTTP and reads its settings through config.py",
        ),
        (
            "songserve.cli",
            "songserve.http.serving",
            "the command line imports only the contract and the HTTP client's settings",
        ),
        ("songserve.http", "songserve.worker.runtime", "the shared HTTP plumbing knows no service that uses it"),
        (
            "songserve.audio",
            "songserve.pipeline.numbers",
            "the audio files are read the same way by every service: they depend on none",
        ),
    ],
)
def test_the_walls_test_catches_an_arrow_it_forbids(tmp_path, room, imported, why):
    """A temporary module in a room that imports across one of its walls: the check names it and says why."""
    probe = tmp_path / "probe.py"
    probe.write_text(f'"""A probe."""\nimport {imported}\n', encoding="utf-8")
    graph = _graph()
    graph[f"{room}.probe"] = _imports(f"{room}.probe", probe)
    broken = [line for line in _broken_walls(graph) if line.startswith(f"{room}.probe ")]
    assert broken[:1] == [f"{room}.probe → {imported}: {why}"]


def test_an_allowed_arrow_is_only_that_one(tmp_path):
    """The worker's settings may read its URL rules, and still no other worker module."""
    probe = tmp_path / "probe.py"
    probe.write_text('"""A probe."""\nfrom songserve.worker import tasks, urls\n', encoding="utf-8")
    graph = {"songserve.worker.settings": _imports("songserve.worker.settings", probe)}
    assert _broken_walls(graph) == [
        "songserve.worker.settings → songserve.worker.tasks: settings are read by the features, never the reverse"
    ]


def test_the_dispatchers_top_is_its_rooms():
    modules = sorted(p.name for p in (PACKAGE / "api").glob("*.py"))
    assert len(modules) <= 12, modules  # at most a dozen modules beside the rooms' folders
    assert all((PACKAGE / "api" / r.rpartition(".")[2] / "__init__.py").exists() for r in ROOMS)


def _loose(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.py"))


def test_the_package_top_is_its_rooms():
    assert len(_loose(PACKAGE)) <= 4, _loose(PACKAGE)  # __init__, __main__ and what every program shares
    assert len(_loose(PACKAGE / "pipeline")) <= 10, _loose(PACKAGE / "pipeline")


ROOMS_LISTED = [
    "http",
    "audio",
    "cli",
    "process",
    "api",
    "worker",
    "pipeline",
    "pipeline/live_audio",
    "pipeline/testing",
]


@pytest.mark.parametrize("room", ROOMS_LISTED)
def test_a_rooms_docstring_lists_each_of_its_modules_once(room):
    folder = PACKAGE / room
    doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text(encoding="utf-8"))) or ""
    counts = {name: len(re.findall(rf"(?<![\w/]){re.escape(name)}\b", doc)) for name in _loose(folder)}
    assert {n: c for n, c in counts.items() if n != "__init__.py" and c != 1} == {}


def test_the_default_folders_are_the_checkouts_not_the_packages():
    """The settings' default folders (``state/``, ``generated_audio/``) sit beside ``run_backend.sh``, as
    the launcher, the containers and the docs say, wherever the settings module lives in the package."""
    from songserve.api.settings import DispatcherSettings
    from songserve.process.settings import ROOT
    from songserve.worker.settings import WorkerSettings

    assert (ROOT / "run_backend.sh").is_file()
    assert DispatcherSettings.model_fields["state_dir"].default == ROOT / "state"
    assert WorkerSettings.model_fields["output_dir"].default == ROOT / "generated_audio"
