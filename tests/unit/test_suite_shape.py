"""The test suite's own shape: every test file in a tier folder, the work units and their order from
measured durations (``tests/support/schedule.py``), and one TLS context for every httpx client."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from tests.support import schedule

TESTS = Path(__file__).resolve().parents[1]
TIERS = ("unit", "integration", "process", "model", "browser")
CLIENT_CALLS = {
    "get",
    "post",
    "put",
    "delete",
    "head",
    "patch",
    "options",
    "request",
    "stream",
    "Client",
    "AsyncClient",
}


def test_every_test_file_is_in_a_tier_folder_and_every_tier_marks_its_tests():
    loose = sorted(p.relative_to(TESTS).as_posix() for p in TESTS.glob("*.py") if p.name != "__init__.py")
    assert loose == ["conftest.py"], f"move these into a tier folder or tests/support/: {loose}"
    assert not list((TESTS / "support").rglob("test_*.py")), "tests/support/ holds helpers, not tests"
    for tier in TIERS:
        conftest = (TESTS / tier / "conftest.py").read_text()
        assert f'mark(item, "{tier}")' in conftest, tier
        assert (TESTS / tier / "__init__.py").exists(), tier


def test_a_file_is_a_unit_but_the_launchers_and_the_crowds_tests_are_one_each_and_a_spread_files_tests_each_one():
    assert schedule.unit_of("model/test_engine.py", "test_a", "test_a", None) == "model/test_engine.py"
    assert schedule.unit_of("process/test_launcher.py", "test_a", "test_a[x]", None) == "launcher"
    assert schedule.unit_of("process/test_listeners.py", "test_a", "test_a", None) == "crowds"
    assert schedule.unit_of("process/test_loop_under_load.py", "test_b", "test_b", None) == "crowds"
    only = {"test_runs_the_launcher"}
    assert schedule.unit_of("process/test_first_hour.py", "test_runs_the_launcher", "test_runs_the_launcher", only) == (
        "launcher"
    )
    assert schedule.unit_of("process/test_first_hour.py", "test_in_process", "test_in_process", only) == (
        "process/test_first_hour.py"
    )
    assert schedule.unit_of("process/test_bench_smoke.py", "test_smoke", "test_smoke[p1]", None) == (
        "process/test_bench_smoke.py::test_smoke[p1]"
    )


def test_the_launcher_crowd_and_spread_files_named_exist():
    missing = sorted(
        name for name in schedule.LAUNCHER | schedule.CROWDS | schedule.SPREAD if not (TESTS / name).exists()
    )
    assert not missing, f"tests/support/schedule.py names files that are not there: {missing}"


def test_unknown_units_go_first_in_their_order_then_the_known_longest_first():
    durations = {"a.py": 5.0, "b.py": 50.0, "launcher": 200.0, "c.py": 5.0}
    units = ["a.py", "new2.py", "b.py", "a.py", "c.py", "launcher", "new1.py"]
    assert schedule.order(units, durations) == ["new2.py", "new1.py", "launcher", "b.py", "a.py", "c.py"]
    assert schedule.order([], durations) == []


def test_durations_are_written_one_unit_a_line_in_tenths_and_read_back(tmp_path):
    text = schedule.dump({"b.py": 12.345, "a.py": 0.04, "launcher": 230.0})
    assert text.splitlines()[1:4] == ['"a.py": 0.0,', '"b.py": 12.3,', '"launcher": 230.0']
    path = tmp_path / "durations.json"
    path.write_text(text)
    assert schedule.load(path) == {"a.py": 0.0, "b.py": 12.3, "launcher": 230.0}
    assert schedule.load(tmp_path / "none.json") == {}


def test_the_checked_in_durations_are_seconds_by_unit():
    durations = json.loads(schedule.DURATIONS.read_text())
    assert durations, "tests/durations.json is empty"
    assert all(isinstance(v, int | float) and v >= 0 for v in durations.values())
    assert schedule.LAUNCHER_UNIT in durations


def _clients_without_the_shared_context(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "httpx"
            and node.func.attr in CLIENT_CALLS
            and not any(k.arg in ("verify", "transport") for k in node.keywords)
        ):
            found.append(f"{path.relative_to(TESTS).as_posix()}:{node.lineno}")
    return found


def test_every_httpx_client_the_tests_make_shares_one_tls_context():
    """Each client httpx makes without ``verify=`` reads and parses a CA bundle (~30 ms of CPU) for
    plain-HTTP requests; ``tests/support/http.py`` holds the one context they share."""
    found = [hit for path in sorted(TESTS.rglob("*.py")) for hit in _clients_without_the_shared_context(path)]
    assert not found, f"pass verify=TLS (from tests.support.http import TLS): {found}"


def _imports_of_test_files(path: Path) -> list[str]:
    """The test modules ``path`` imports from (``tests.<tier>.test_*``): what two files share goes to
    tests/support/, so a file runs, moves or is removed without another's tests coming along."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        found += [n for n in names if n.split(".")[0] == "tests" and n.split(".")[-1].startswith("test_")]
    return found


def test_no_test_file_imports_another():
    found = {
        p.relative_to(TESTS).as_posix(): hits
        for p in sorted(TESTS.rglob("*.py"))
        if (hits := _imports_of_test_files(p))
    }
    assert not found, f"move what these share into tests/support/: {found}"


def test_the_import_check_sees_one(tmp_path):
    probe = tmp_path / "test_probe.py"
    probe.write_text(
        "from tests.process.test_scaleout import job\nimport tests.unit.test_x\nfrom tests.support import x\n"
    )
    assert _imports_of_test_files(probe) == ["tests.process.test_scaleout", "tests.unit.test_x"]
