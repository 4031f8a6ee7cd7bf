"""The dispatch pass's plan (``api/dispatch/placement.py:plan``) over tables of cases: pure, no event loop, no
store; the pass that applies it is proved by the in-process state tests (``test_dispatch_states.py``)."""

from __future__ import annotations

import httpx
import pytest

from songserve.api.dispatch.placement import NO_PREFIX, NO_WORKER, NOT_ENCODED, NOT_THERE_AGAIN, Plan, PlanFacts, plan
from songserve.api.dispatch.pool import WorkerHandle
from songserve.api.dispatch.queue_order import QueueEntry, order
from songserve.api.jobs.records import Job, Key, Track
from songserve.api.jobs.states import TrackStatus
from songserve.api.workers.client import REFERENCE, WorkerClient, WorkerHttp
from songserve.schemas import GenerateRequest, WorkerConfig, WorkerHealth
from tests.support.http import TLS

pytestmark = pytest.mark.quick
HTTP = WorkerHttp.shared(httpx.AsyncClient(verify=TLS))
ORIGINAL = "0123456789abcdef"


def worker(worker_id: int, batch: int = 1, reference: bool = False, holds: str = "") -> WorkerHandle:
    client = WorkerClient(HTTP, f"http://w{worker_id}")
    if reference:
        client.kind = REFERENCE
    slots = [{"model": "default_backbone", "origin": holds, "tokens": 900, "bytes": 1}] if holds else []
    w = WorkerHandle(worker_id, client, online=True, health=WorkerHealth(status="idle", kv_snapshots={"slots": slots}))
    w.config = WorkerConfig(max_batch=batch)
    w.lease_held(1, "me")
    w.lease_usable_until(float("inf"))
    return w


def job(job_id: str, takes: int, seq: int, priority: int = 0, retake: bool = False, upload: bool = False) -> Job:
    cf = None
    if retake:
        cf = {"job_id": ORIGINAL, "track_index": 0, "at_sec": 20.0}
    if upload:
        cf = {"upload_id": "e" * 16, "at_sec": 20.0}
    req = GenerateRequest.model_validate({"tags": "pop", "num_tracks": takes, "continue_from": cf})
    tracks = [Track(job_id, i, i + 1) for i in range(takes)]
    return Job(job_id=job_id, seq=seq, created_at=0.0, request=req, cleaned_lyrics="", tracks=tracks, priority=priority)


def plan_of(jobs: list[Job], free: list[WorkerHandle], pack: str = "auto", **facts: object) -> Plan:
    """The plan for every queued track of ``jobs``, in queue order, as the pass asks for it."""
    entries = [
        QueueEntry(j.job_id, t.index, j.priority, j.seq) for j in jobs for t in j.tracks if t.status.value == "queued"
    ]
    ordered = order(entries, {})
    queued = {(e.job_id, e.index) for e in ordered}
    fleet = facts.pop("fleet", free)
    return plan(ordered, {j.job_id: j for j in jobs}, queued, free, PlanFacts(pack, fleet, **facts))  # type: ignore[arg-type]


def placed(p: Plan) -> list[tuple[int, list[Key]]]:
    return [(a.worker.worker_id, a.keys) for a in p.assignments]


A, B, C = "a" * 16, "b" * 16, "c" * 16

# name, jobs, free workers, PACK_TRACKS → (worker, takes) in order; tracks that wait, and why
CASES = [
    ("one track per free worker, in the pool's order",
     lambda: [job(A, 1, 1), job(B, 1, 2)], lambda: [worker(0), worker(1)], "auto",
     [(0, [(A, 0)]), (1, [(B, 0)])], {}),
    ("more queued than free: the rest wait for a worker",
     lambda: [job(A, 1, 1), job(B, 1, 2), job(C, 1, 3)], lambda: [worker(0)], "auto",
     [(0, [(A, 0)])], {(B, 0): NO_WORKER, (C, 0): NO_WORKER}),
    ("higher priority goes first",
     lambda: [job(A, 1, 1), job(B, 1, 2, priority=5)], lambda: [worker(0)], "auto",
     [(0, [(B, 0)])], {(A, 0): NO_WORKER}),
    ("round robin over jobs: a 3-take job does not hold both workers",
     lambda: [job(A, 3, 1), job(B, 1, 2)], lambda: [worker(0), worker(1)], "never",
     [(0, [(A, 0)]), (1, [(B, 0)])], {(A, 1): NO_WORKER, (A, 2): NO_WORKER}),
    ("auto packs a job's takes when more are queued than workers are free",
     lambda: [job(A, 3, 1)], lambda: [worker(0, batch=4)], "auto",
     [(0, [(A, 0), (A, 1), (A, 2)])], {}),
    ("auto leaves the other free workers their share",
     lambda: [job(A, 3, 1)], lambda: [worker(0, batch=4), worker(1, batch=4)], "auto",
     [(0, [(A, 0), (A, 1)]), (1, [(A, 2)])], {}),
    ("never packs: one take each",
     lambda: [job(A, 2, 1)], lambda: [worker(0, batch=4)], "never",
     [(0, [(A, 0)])], {(A, 1): NO_WORKER}),
    ("always packs up to the worker's batch",
     lambda: [job(A, 3, 1)], lambda: [worker(0, batch=2), worker(1, batch=2)], "always",
     [(0, [(A, 0), (A, 1)]), (1, [(A, 2)])], {}),
    ("a worker without batches takes one take",
     lambda: [job(A, 2, 1)], lambda: [worker(0)], "always",
     [(0, [(A, 0)])], {(A, 1): NO_WORKER}),
    ("a retake goes to the worker holding a snapshot of its original, its takes together",
     lambda: [job(A, 2, 1, retake=True)], lambda: [worker(0, batch=4), worker(1, batch=4, holds=f"{ORIGINAL}/0")], "auto",
     [(1, [(A, 0), (A, 1)])], {}),
    ("a retake never goes to a reference worker: it waits",
     lambda: [job(A, 1, 1, retake=True), job(B, 1, 2)], lambda: [worker(0, reference=True)], "auto",
     [(0, [(B, 0)])], {(A, 0): NO_PREFIX}),
]  # fmt: skip


@pytest.mark.parametrize(("jobs", "free", "pack", "want", "waiting"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_the_plan_places_the_queue_on_the_free_workers(jobs, free, pack, want, waiting):
    p = plan_of(jobs(), free(), pack)
    assert placed(p) == want
    assert p.waiting == waiting


def test_a_continued_upload_still_encoding_waits_and_one_that_failed_starts_to_fail_saying_why():
    encoding, failed, plain = job(A, 1, 1, upload=True), job(B, 1, 2, upload=True), job(C, 1, 3)
    p = plan_of([encoding, failed, plain], [worker(0), worker(1)], frames={A: None, B: "its upload failed"})
    assert placed(p) == [(0, [(B, 0)]), (1, [(C, 0)])]
    assert p.assignments[0].missing == "its upload failed"
    assert p.waiting == {(A, 0): NOT_ENCODED}


def test_a_retry_waits_for_another_worker_than_the_one_it_failed_on_while_one_could_take_it():
    j = job(A, 1, 1)
    j.tracks[0].avoid_worker = 0
    failed, busy = worker(0), worker(1)
    busy.assign(("x" * 16, 0), "other-task")
    assert plan_of([j], [failed], fleet=[failed, busy]).waiting == {(A, 0): NOT_THERE_AGAIN}
    assert placed(plan_of([j], [failed], fleet=[failed])) == [(0, [(A, 0)])]  # no other: it may go back


def test_tracks_tried_already_in_this_pass_or_no_longer_queued_here_are_skipped():
    j = job(A, 3, 1)
    j.tracks[2].status = TrackStatus.generating  # another dispatcher's claim, merged meanwhile
    entries = order([QueueEntry(A, i, 0, 1) for i in range(3)], {})
    p = plan(entries, {A: j}, {(A, 0), (A, 1), (A, 2)}, [worker(0), worker(1)], PlanFacts("never"), taken={(A, 0)})
    assert placed(p) == [(0, [(A, 1)])]
    assert p.waiting == {}
    gone = plan(entries, {}, {(A, 0)}, [worker(0)], PlanFacts("never"))  # its job ended meanwhile
    assert gone == Plan()


def test_a_plan_changes_nothing_it_is_given():
    j, w = job(A, 2, 1), worker(0, batch=2)
    plan_of([j], [w], "always")
    assert [t.status for t in j.tracks] == [TrackStatus.queued, TrackStatus.queued]
    assert not w.assigned
    assert w.available
