"""The worker's status moves only along its table (``worker/states.py``); the runtime keeps to it."""

from __future__ import annotations

from pathlib import Path

import pytest

from songserve.errors import BusyError
from songserve.pipeline.testing.tone import TonePipeline
from songserve.process.settings import load_settings
from songserve.schemas import ErrorKind, TaskState, WorkerStatus
from songserve.worker.device import ToneDevice
from songserve.worker.runtime import WorkerRuntime
from songserve.worker.settings import WorkerSettings
from songserve.worker.states import IllegalTransition, check_transition

pytestmark = pytest.mark.quick

S = WorkerStatus
LEGAL = [(S.initializing, S.idle), (S.initializing, S.error), (S.idle, S.busy), (S.busy, S.idle)]


@pytest.mark.parametrize(("old", "new"), LEGAL)
def test_a_move_in_the_table_is_allowed(old, new):
    check_transition(old, new)


@pytest.mark.parametrize("status", list(S))
def test_staying_is_no_move(status):
    check_transition(status, status)


@pytest.mark.parametrize(
    ("old", "new"),
    [(o, n) for o in S for n in S if o != n and (o, n) not in LEGAL],
)
def test_every_other_move_is_refused(old, new):
    with pytest.raises(IllegalTransition, match=f"from {old} to {new}"):
        check_transition(old, new)


def test_an_error_is_for_good():
    for new in (S.idle, S.busy, S.initializing):
        with pytest.raises(IllegalTransition):
            check_transition(S.error, new)


def test_nothing_moves_into_stalled_which_health_derives():
    for old in S:
        if old is not S.stalled:
            with pytest.raises(IllegalTransition):
                check_transition(old, S.stalled)


# -- the runtime: its claims, ends and failures keep to the table ------------------------------------------------------------------


def _runtime(tmp_path: Path) -> WorkerRuntime:
    s = load_settings(WorkerSettings, [], pipeline="test", output_dir=tmp_path)
    return WorkerRuntime(s, TonePipeline(s), ToneDevice())


def test_the_runtime_refuses_a_status_outside_the_table(tmp_path: Path) -> None:
    rt = _runtime(tmp_path)
    with pytest.raises(IllegalTransition):
        rt.status = S.busy  # not loaded yet
    assert rt.status is S.initializing


def test_a_worker_still_loading_refuses_a_task_and_stays_as_it_is(tmp_path: Path) -> None:
    rt = _runtime(tmp_path)
    with pytest.raises(BusyError, match="initializing"):
        rt._claim_ids(["t1"])
    assert (rt.status, rt.tasks.current) == (S.initializing, None)


def test_a_claim_makes_the_worker_busy_and_its_end_idle_again(tmp_path: Path) -> None:
    rt = _runtime(tmp_path)
    rt.status = S.idle
    ctxs = rt._claim_ids(["t1", "t2"])
    assert rt.status is S.busy
    assert [c.task_id for c in rt.tasks.batch] == ["t1", "t2"]
    with pytest.raises(BusyError, match="already running task t1"):
        rt._claim_ids(["t3"])
    rt._end()
    assert (rt.status, rt.tasks.current, rt.phase) == (S.idle, None, "idle")
    assert ctxs[0].task_id == "t1"


def test_a_failure_nobody_asked_for_is_classified_remembered_and_answered(tmp_path: Path) -> None:
    rt = _runtime(tmp_path)
    failure = rt._failed("t1", ZeroDivisionError("inside"), "failed")
    assert (failure.kind, str(failure)) == (ErrorKind.model, "The task failed inside the model (ZeroDivisionError).")
    view = rt.tasks.get("t1")
    assert view is not None
    assert (view.status, view.error, view.error_kind) == (TaskState.error, str(failure), ErrorKind.model)
