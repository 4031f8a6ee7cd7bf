"""The package's shape: no import cycles, a docstring each, and the walls between the dispatcher's rooms.

Modules are sized by the concept they hold, not by a line count: no cap is checked here.

Imports are read from the source (every ``import``/``from … import`` of a ``songserve`` module,
at module level, inside functions and under ``TYPE_CHECKING`` alike): a cycle hidden behind a lazy
import is still a cycle for a reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

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
    ("songserve.settings", ("songserve.api", "songserve.worker", "songserve.pipeline"), "the shared loader is below every program"),
]  # fmt: skip


def _under(module: str, prefix: str) -> bool:
    return module == prefix.rstrip(".") or module.startswith(prefix if prefix.endswith(".") else prefix + ".")


def _broken_walls(graph: dict[str, set[str]]) -> list[str]:
    broken = []
    for module, targets in sorted(graph.items()):
        for source, forbidden, why in WALLS:
            if not _under(module, source):
                continue
            for target in sorted(targets):
                if any(_under(target, f) for f in forbidden) and not _under(target, source):
                    broken.append(f"{module} → {target}: {why}")
    return broken


def test_the_dispatchers_rooms_keep_their_walls():
    assert _broken_walls(_graph()) == []


def test_the_walls_test_catches_an_arrow_it_forbids(tmp_path):
    """A temporary module in the store's room that imports the dispatcher: the check names it."""
    probe = tmp_path / "probe.py"
    probe.write_text('"""A probe."""\nfrom songserve.api.dispatch.dispatcher import Dispatcher\n', encoding="utf-8")
    graph = _graph()
    graph["songserve.api.store.probe"] = _imports("songserve.api.store.probe", probe)
    assert _broken_walls(graph) == [
        "songserve.api.store.probe → songserve.api.dispatch.dispatcher: "
        "the store keeps records; it never calls the parts that change them"
    ]


def test_the_dispatchers_top_is_its_rooms():
    modules = sorted(p.name for p in (PACKAGE / "api").glob("*.py"))
    assert len(modules) <= 12, modules  # at most a dozen modules beside the rooms' folders
    assert all((PACKAGE / "api" / r.rpartition(".")[2] / "__init__.py").exists() for r in ROOMS)
