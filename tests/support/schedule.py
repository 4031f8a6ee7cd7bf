"""The suite's work units and their order, from the durations a whole run measured (a pytest plugin).

``bash scripts/test`` runs the suite with ``pytest -n N --dist loadgroup --no-loadscope-reorder``:
xdist hands each unit (an ``xdist_group``) to whichever test process is free, in the order the units
first appear in the collection. A long unit handed out near the end is what stretches a run, so the
units are ordered here longest first, from ``tests/durations.json``:

- every file is a unit of its own (its module fixtures are built once), but for the files in
  ``SPREAD``, whose every test is a unit (slow tests and no module fixtures);
- the launcher's real-process tests (the files in ``LAUNCHER``; of a file that sets
  ``LAUNCHER_TESTS``, those tests only) are one unit, ``launcher``, run in order on one process: two
  of them hold the reference's port 8791, and every one starts the README's command with its
  workers and dispatcher;
- the tests that measure the dispatcher's own event loop under a crowd (``CROWDS``: a thousand
  waiting clients, hundreds of MP3 listeners) are one unit, ``crowds``, so that two crowds never
  share this machine's cores: each measures one dispatcher's lag, not how many crowds ran at once;
- a unit ``durations.json`` does not know (a new file or test) goes first, in collection order: it
  may be long, and a short one handed out first costs nothing; the known ones follow, longest first.

``SONGSERVE_TEST_DURATIONS=record`` writes ``durations.json`` anew at the end of a run of the whole
suite that passed (no paths, ``-k`` or ``-m``; a part of a unit is not its time): each unit's wall
time, the sum of its tests' setup, call and teardown. Each report carries its unit's name in
``user_properties``, so the xdist controller, which collects nothing, can add them up. Without xdist
the groups do nothing but the order still holds.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
DURATIONS = TESTS / "durations.json"
RECORD_ENV = "SONGSERVE_TEST_DURATIONS"

LAUNCHER_UNIT = "launcher"
LAUNCHER = {
    "process/test_launcher.py",
    "process/test_launcher_stop.py",
    "process/test_launcher_ports.py",
    "process/test_ports.py",
    "process/test_first_hour.py",
    "process/test_left_behind.py",
    "process/test_caller_paths.py",
    "process/test_announce.py",
    "process/test_reference_requests.py",
}
SPREAD = {"process/test_bench_smoke.py"}
CROWD_UNIT = "crowds"
CROWDS = {"process/test_loop_under_load.py", "process/test_listeners.py"}


def unit_of(path: str, name: str, test_id: str, launcher_tests: Collection[str] | None) -> str:
    """The unit of one test: ``path`` its file relative to ``tests/``, ``name`` its function's name,
    ``test_id`` its id after the file (``test_x[param]``), ``launcher_tests`` its file's
    ``LAUNCHER_TESTS`` where the file sets one."""
    if path in LAUNCHER and (launcher_tests is None or name in launcher_tests):
        return LAUNCHER_UNIT
    if path in CROWDS:
        return CROWD_UNIT
    if path in SPREAD:
        return f"{path}::{test_id}"
    return path


def order(units: Iterable[str], durations: Mapping[str, float]) -> list[str]:
    """The units in the order they are handed out: the unknown ones first (in the order given), then
    the known ones longest first (ties in the order given)."""
    seen = list(dict.fromkeys(units))
    unknown = [u for u in seen if u not in durations]
    known = sorted((u for u in seen if u in durations), key=lambda u: -durations[u])
    return unknown + known


def load(path: Path = DURATIONS) -> dict[str, float]:
    """The recorded durations (an empty map where there is no file yet)."""
    if not path.exists():
        return {}
    return {str(k): float(v) for k, v in json.loads(path.read_text()).items()}


def dump(durations: Mapping[str, float]) -> str:
    """The file's text: one unit a line, by name, in tenths of a second (a refresh diffs line by line)."""
    rounded = {unit: round(float(seconds), 1) for unit, seconds in sorted(durations.items())}
    return json.dumps(rounded, indent=0) + "\n"


class _Recorder:
    """Adds up each unit's time from the test reports of this run; writes them at its end."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def add(self, report: pytest.TestReport) -> None:
        unit = dict(report.user_properties).get("unit")
        if isinstance(unit, str):
            self.seconds[unit] = self.seconds.get(unit, 0.0) + report.duration


_recorder: _Recorder | None = None


def _whole_suite(config: pytest.Config) -> bool:
    return (
        config.args_source == pytest.Config.ArgsSource.TESTPATHS
        and not config.option.keyword
        and not config.option.markexpr
    )


def pytest_configure(config: pytest.Config) -> None:
    global _recorder
    if os.environ.get(RECORD_ENV) == "record" and not hasattr(config, "workerinput"):
        _recorder = _Recorder()  # in the xdist controller, or the one process without xdist


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which names each test's unit after its mark
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    units: dict[int, str] = {}
    for item in items:
        path = Path(os.path.relpath(item.path, TESTS)).as_posix()
        module = getattr(item, "module", None)
        name = getattr(item, "originalname", item.name)
        unit = unit_of(path, name, item.nodeid.partition("::")[2], getattr(module, "LAUNCHER_TESTS", None))
        units[id(item)] = unit
        item.add_marker(pytest.mark.xdist_group(unit))
        item.user_properties.append(("unit", unit))
    rank = {unit: i for i, unit in enumerate(order((units[id(i)] for i in items), load()))}
    items.sort(key=lambda item: rank[units[id(item)]])  # stable: each unit keeps its tests' order


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _recorder is not None:
        _recorder.add(report)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _recorder is None or hasattr(session.config, "workerinput"):
        return
    if exitstatus != 0 or not _whole_suite(session.config):
        print(
            f"\n{RECORD_ENV}=record: {DURATIONS.name} left as it was (a run of the whole suite that passed writes it)"
        )
        return
    DURATIONS.write_text(dump(_recorder.seconds))
    print(f"\n{RECORD_ENV}=record: {len(_recorder.seconds)} units written to {DURATIONS}")
