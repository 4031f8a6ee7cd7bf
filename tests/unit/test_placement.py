"""Which free worker a track goes to (``api/dispatch/placement.py``), in-process: retakes to our workers, the
snapshot's holder first; every other track as before."""

from __future__ import annotations

import httpx

from songserve.api.dispatch.placement import NO_ADAPTER, NO_PARTS, NO_WORKER, PlanFacts, pack, pick, plan, repaints
from songserve.api.dispatch.pool import WorkerHandle
from songserve.api.dispatch.queue_order import QueueEntry
from songserve.api.jobs.records import Job, Track
from songserve.api.workers.client import REFERENCE, WorkerClient, WorkerHttp
from songserve.schemas import GenerateRequest, WorkerConfig, WorkerHealth
from songserve.schemas.worker import AdapterHeld, AdaptersHealth
from tests.support.http import TLS

ORIGINAL = "0123456789abcdef"


def handle(worker_id: int, origins: tuple[str, ...] = (), reference: bool = False) -> WorkerHandle:
    client = WorkerClient(WorkerHttp.shared(httpx.AsyncClient(verify=TLS)), f"http://w{worker_id}")
    if reference:
        client.kind = REFERENCE
    slots = [{"model": "default_backbone", "origin": o, "tokens": 900, "bytes": 1} for o in origins]
    return WorkerHandle(
        worker_id, client, online=True, health=WorkerHealth(status="idle", kv_snapshots={"slots": slots})
    )


def job(retake: bool, end_sec: float | None = None) -> Job:
    """A job from the prompt alone, or a retake of ``ORIGINAL``'s take from 20 s (with ``end_sec``: a repaint)."""
    cf = {"job_id": ORIGINAL, "track_index": 0, "at_sec": 20.0, "end_sec": end_sec} if retake else None
    req = GenerateRequest.model_validate({"tags": "pop", "continue_from": cf})
    return Job(
        job_id="fedcba9876543210",
        seq=1,
        created_at=0.0,
        request=req,
        cleaned_lyrics="",
        tracks=[Track("fedcba9876543210", 0, 1)],
    )


def test_a_retake_goes_to_the_idle_worker_holding_a_snapshot_of_its_original():
    free = [handle(0), handle(1, ("other/0",)), handle(2, (f"{ORIGINAL}/0",))]
    j = job(retake=True)
    assert pick(free, j, j.tracks[0]) is free[2]


def kept(w: WorkerHandle, *origins: str) -> WorkerHandle:
    w.health = w.health.model_copy(update={"kept_audio": {"origins": list(origins)}})
    return w


def test_an_edit_goes_to_the_worker_holding_its_originals_decoded_audio_a_retake_to_its_snapshot():
    mine = f"{ORIGINAL}/0"
    free = [handle(0), kept(handle(1), "x/1", mine), handle(2, (mine,))]
    e, r = job(retake=True, end_sec=30.0), job(retake=True)
    assert pick(free, e, e.tracks[0]) is free[1]  # the first of the holders (of either), in the pool's order
    assert pick(free, r, r.tracks[0]) is free[2]  # a retake decodes its whole new part: only the snapshot counts
    both = kept(handle(3, (mine,)), mine)
    assert pick([*free, both], e, e.tracks[0]) is both  # holding both comes first


def test_without_a_holder_a_retake_takes_the_first_of_our_workers_never_a_reference_one():
    free = [handle(0, reference=True), handle(1), handle(2)]
    j = job(retake=True)
    assert pick(free, j, j.tracks[0]) is free[1]
    assert pick([handle(0, reference=True)], j, j.tracks[0]) is None  # it waits for one of ours


def test_other_tracks_keep_the_pool_order_and_avoid_the_worker_they_just_failed_on():
    free = [handle(0, reference=True), handle(1), handle(2, (f"{ORIGINAL}/0",))]
    j = job(retake=False)
    assert pick(free, j, j.tracks[0]) is free[0]
    j.tracks[0].avoid_worker = 0
    assert pick(free, j, j.tracks[0]) is free[1]


def test_a_retry_waits_for_another_worker_rather_than_going_back_to_the_one_that_failed_it():
    failed, busy = handle(0), handle(1)
    failed.leased = busy.leased = True
    busy.assigned["other-task"] = ("0000000000000000", 0)
    j = job(retake=False)
    j.tracks[0].avoid_worker = 0
    assert pick([failed], j, j.tracks[0], [failed, busy]) is None  # only the failed one is free: wait
    assert pick([failed], j, j.tracks[0], [failed]) is failed  # no other worker: it may go back
    busy.benched_until, busy.bench_reason = (
        1e18,
        "benched",
    )  # out of rotation: it cannot take the track, so waiting would be for ever
    assert pick([failed], j, j.tracks[0], [failed, busy]) is failed
    busy.benched_until, busy.online = 0.0, False
    assert pick([failed], j, j.tracks[0], [failed, busy]) is failed  # nor an offline one


def test_a_retake_that_failed_on_the_snapshots_holder_goes_to_another_of_our_workers():
    holder, other = handle(0, (f"{ORIGINAL}/0",)), handle(1)
    j = job(retake=True)
    j.tracks[0].avoid_worker = 0
    assert pick([holder, other], j, j.tracks[0]) is other


def with_adapters(worker_id: int, available: tuple[str, ...], resident: tuple[str, ...] = ()) -> WorkerHandle:
    w = handle(worker_id)
    held = AdaptersHealth(
        resident=[AdapterHeld(name=n, rank=4) for n in resident], capacity=4, available=list(available)
    )
    w.health = w.health.model_copy(update={"adapters": held})
    return w


def adapter_job(*choices: str | None) -> Job:
    takes = [{"adapter": c} for c in choices]
    req = GenerateRequest.model_validate({"tags": "pop", "num_tracks": len(choices), "takes": takes})
    tracks = [Track("fedcba9876543210", i, 1 + i) for i in range(len(choices))]
    return Job(job_id="fedcba9876543210", seq=1, created_at=0.0, request=req, cleaned_lyrics="", tracks=tracks)


def test_a_take_with_an_adapter_goes_to_a_worker_that_can_load_it_one_that_holds_it_first():
    free = [handle(0), with_adapters(1, ("a", "b")), with_adapters(2, ("a", "b"), resident=("b",))]
    j = adapter_job("a", "b", None)
    assert pick(free, j, j.tracks[0]) is free[1]  # the first that can load it
    assert pick(free, j, j.tracks[1]) is free[2]  # the one that holds it
    assert pick(free, j, j.tracks[2]) is free[0]  # no adapter: any worker, in the pool's order
    assert pick([handle(0), with_adapters(1, ("b",))], j, j.tracks[0]) is None  # nobody can load "a": it waits


def test_a_batch_packs_only_the_takes_whose_adapters_its_worker_can_load_and_waits_say_why():
    j = adapter_job("a", "c", "b", None)
    w = with_adapters(1, ("a", "b"))
    w.config = WorkerConfig(max_batch=4)
    more = pack(j, w, "always", queued_after=3, free_after=0, taken={j.tracks[0].key})
    assert [t.index for t in more] == [2, 3]  # "c" is not on this worker
    entries = [QueueEntry(j.job_id, i, 0, 1) for i in range(4)]
    out = plan(entries, {j.job_id: j}, {t.key for t in j.tracks}, [w], PlanFacts("never"))
    assert [a.keys for a in out.assignments] == [[j.tracks[0].key]]
    assert out.waiting[j.tracks[1].key] == NO_WORKER  # the only worker is taken by then


def test_without_any_worker_that_can_load_it_a_take_waits_saying_so():
    j = adapter_job("c")
    out = plan(
        [QueueEntry(j.job_id, 0, 0, 1)], {j.job_id: j}, {j.tracks[0].key}, [with_adapters(1, ("a",))], PlanFacts("auto")
    )
    assert out.waiting[j.tracks[0].key] == NO_ADAPTER


def test_a_repaint_of_several_parts_goes_only_to_a_worker_that_writes_that_many_and_else_waits_saying_so():
    parts = [{"at_sec": 1.0, "end_sec": 2.0}, {"at_sec": 5.0, "end_sec": 6.0}]
    req = GenerateRequest.model_validate({"continue_from": {"job_id": ORIGINAL, "parts": parts}})
    j = Job(
        job_id="fedcba9876543210",
        seq=1,
        created_at=0.0,
        request=req,
        cleaned_lyrics="",
        tracks=[Track("fedcba9876543210", 0, 1)],
    )
    older, newer = handle(0), handle(1)
    older.config, newer.config = WorkerConfig(), WorkerConfig(repaint_parts=8)
    assert pick([older, newer], j, j.tracks[0]) is newer
    assert pick([older], j, j.tracks[0]) is None
    one = job(retake=True)
    assert pick([older, newer], one, one.tracks[0]) is older  # one part: any worker of ours
    out = plan([QueueEntry(j.job_id, 0, 0, 1)], {j.job_id: j}, {j.tracks[0].key}, [older], PlanFacts("auto"))
    assert out.waiting[j.tracks[0].key] == NO_PARTS


def test_a_repaint_of_several_parts_is_refused_at_once_only_where_no_worker_could_ever_take_it():
    older, newer, unread, theirs = handle(0), handle(1), handle(2), handle(3, reference=True)
    older.config, newer.config, theirs.config = WorkerConfig(), WorkerConfig(repaint_parts=8), WorkerConfig()
    assert repaints([], 2)  # no worker known yet: it waits for one
    assert repaints([older, newer], 8)
    assert not repaints([older, newer], 9)
    assert not repaints([older, theirs], 2)  # an older worker of ours and the reference's: never
    assert repaints([older], 1)
    assert repaints([older, unread], 2)  # its /config is not read yet: it may
