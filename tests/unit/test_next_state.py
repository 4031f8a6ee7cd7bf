"""How an attempt ended → its track's next state (``api/dispatch/retries.py:next_state``), as a table: pure,
no event loop, no store, no worker."""

from __future__ import annotations

import pytest

from songserve.api.dispatch.retries import Next, NextState, RetryTrack, Tries, next_state
from songserve.api.workers.outcomes import Outcome, OutcomeKind
from songserve.schemas import WorkerGenerateResult

pytestmark = pytest.mark.quick

RESULT = WorkerGenerateResult.model_construct()  # only its presence matters here
DONE = Outcome(OutcomeKind.done, result=RESULT)
FIRST = Tries(attempts=1, env_failures=0, max_attempts=3, workers=2)  # share of environment failures: 6
LAST = Tries(attempts=3, env_failures=0, max_attempts=3, workers=2)
SHARE_SPENT = Tries(attempts=1, env_failures=5, max_attempts=3, workers=2)

CASES = [
    # name, how it ended, tries, job cancelled, → next state
    ("a finished take is collected", DONE, FIRST, False, NextState(Next.collect, 1, 0)),
    ("a finished take of a cancelled job is not", DONE, FIRST, True, NextState(Next.cancelled, 1, 0)),
    ("a finished take without its result is the model's error",
     Outcome(OutcomeKind.done, error="no result"), FIRST, False, NextState(Next.error, 1, 0, "no result")),
    ("the model's clear sentence ends the track at once",
     Outcome(OutcomeKind.error, error="Lyrics too long."), FIRST, False, NextState(Next.error, 1, 0, "Lyrics too long.")),
    ("the model's error stays an error in a cancelled job",
     Outcome(OutcomeKind.error, error="Lyrics too long."), FIRST, True, NextState(Next.error, 1, 0, "Lyrics too long.")),
    ("an environment failure runs again, its try given back",
     Outcome(OutcomeKind.error, error="disk full", environment=True), FIRST, False,
     NextState(Next.queued, 0, 1, "worker 4: disk full", retried=True)),
    ("past the fleet's share environment failures are errors",
     Outcome(OutcomeKind.error, error="disk full", environment=True), SHARE_SPENT, False,
     NextState(Next.error, 1, 5, "disk full")),
    ("a task the worker stopped runs again, counted",
     Outcome(OutcomeKind.cancelled), FIRST, False, NextState(Next.queued, 1, 0, "worker 4 stopped the task", retried=True)),
    ("a task stopped for the user's cancel ends cancelled", Outcome(OutcomeKind.cancelled), FIRST, True,
     NextState(Next.cancelled, 1, 0)),
    ("a busy worker gives the try back", Outcome(OutcomeKind.busy), LAST, False,
     NextState(Next.queued, 2, 0, "worker 4 was busy", retried=True)),
    ("a lost connection costs a try", RetryTrack("worker 4 connection lost"), FIRST, False,
     NextState(Next.queued, 1, 0, "worker 4 connection lost", retried=True)),
    ("the last try lost ends in error with the reason", RetryTrack("worker 4 connection lost"), LAST, False,
     NextState(Next.error, 3, 0, "Track failed after 3 attempts: worker 4 connection lost.", retried=True)),
    ("a failure in a cancelled job ends cancelled", RetryTrack("past its deadline"), LAST, True,
     NextState(Next.cancelled, 3, 0, retried=True)),
    ("a worker that left the pool gives the try back", RetryTrack("its worker left", count=False), LAST, False,
     NextState(Next.queued, 2, 0, "its worker left", retried=True)),
    ("a worker's own fault is counted as an environment failure",
     RetryTrack("worker 4: bad files", environment=True), FIRST, False,
     NextState(Next.queued, 0, 1, "worker 4: bad files", retried=True)),
    ("a fleet whose every worker misbehaves ends the track",
     RetryTrack("worker 4: bad files", environment=True), Tries(3, 5, 3, 2), False,
     NextState(Next.error, 3, 6, "Track failed after 3 attempts: worker 4: bad files.", retried=True)),
]  # fmt: skip


@pytest.mark.parametrize(("end", "tries", "cancelled", "want"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_an_attempts_end_gives_its_tracks_next_state(end, tries, cancelled, want):
    assert next_state(end, tries, cancelled, worker_id=4) == want
