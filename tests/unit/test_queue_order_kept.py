"""The track book keeps the queue's order between changes (``TrackBook.ordered``): after any run of adds,
merges from the store and removals it is exactly what ``queue_order.order`` gives for the queue as it is
now, and the positions follow it. Pure: the book's synchronous methods, no event loop, no store."""

from __future__ import annotations

import dataclasses
import random
from typing import cast

import pytest

from songserve.api.dispatch import queue_order
from songserve.api.dispatch.tracks import TrackBook
from songserve.api.jobs.records import Job, Key, Track
from songserve.api.jobs.states import TrackStatus
from songserve.api.metrics import DispatcherMetrics
from songserve.api.store.protocol import JobStore
from songserve.schemas import GenerateRequest

pytestmark = pytest.mark.quick
STATUSES = [TrackStatus.queued] * 3 + [TrackStatus.generating, TrackStatus.decoding, TrackStatus.done]


def book() -> TrackBook:
    return TrackBook(cast(JobStore, None), "me", DispatcherMetrics())


def new_job(rng: random.Random, seq: int) -> Job:
    takes = rng.randint(1, 4)
    req = GenerateRequest.model_validate({"tags": "pop", "num_tracks": takes})
    tracks = [Track(f"j{seq}", i, i, status=rng.choice(STATUSES)) for i in range(takes)]
    return Job(f"j{seq}", seq, 0.0, req, "", tracks, priority=rng.choice([0, 0, 1, 5]))


def stored_copy(rng: random.Random, job: Job) -> Job:
    """The job as the store might hold it now: some of its tracks moved on, or back to the queue."""
    tracks = [dataclasses.replace(t, status=rng.choice(STATUSES)) if rng.random() < 0.4 else t for t in job.tracks]
    return dataclasses.replace(job, tracks=[dataclasses.replace(t) for t in tracks])


def assert_in_order(b: TrackBook) -> None:
    want = queue_order.order(b.queue.values(), b.started_counts())
    assert b.ordered() == want
    b.reorder()
    assert b.positions == {(e.job_id, e.index): i + 1 for i, e in enumerate(want)}


@pytest.mark.parametrize("seed", range(40))
def test_the_kept_order_is_the_order_of_the_queue_as_it_is_after_any_run_of_changes(seed):
    rng = random.Random(seed)
    b, seq = book(), 0
    for _ in range(120):
        roll = rng.random()
        if roll < 0.35 or not b.jobs:
            seq += 1
            b.add(new_job(rng, seq))
        elif roll < 0.85:  # the store's state of a job, some of its tracks running here (``live``)
            job = b.jobs[rng.choice(sorted(b.jobs))]
            live: set[Key] = {t.key for t in job.tracks if t.status.running and rng.random() < 0.3}
            b.merge(job.job_id, stored_copy(rng, job), live)
        else:  # the job ended in the store
            b.merge(rng.choice(sorted(b.jobs)), None, ())
        if rng.random() < 0.5:  # the order is asked for between some changes, not all
            assert_in_order(b)
    assert_in_order(b)


def test_a_reorder_that_moves_no_position_wakes_no_stream():
    rng = random.Random(1)
    b = book()
    for seq in range(1, 30):
        b.add(new_job(rng, seq))
    b.reorder()
    seen = b.changes.version
    b.reorder()
    b.merge("j3", stored_copy(random.Random(0), b.jobs["j3"]), ())  # a merge is a change of its own
    after_merge = b.changes.version
    b.reorder()
    b.reorder()
    assert seen > 0
    assert b.changes.version - after_merge <= 1  # only if the merge moved a position
