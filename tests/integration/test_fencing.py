"""Fencing by lease epoch, the same rules on both engines, in-process.

A claim and every later write for a track on a worker carry the ``Fence`` (owner, worker, epoch) its
writer holds; the store checks it against the lease row, and the lease's expiry on its own clock, in
the same statement. These tests drive the store directly (``test_store_engines.py``'s helpers) and,
at the end, one dispatcher over fake workers whose lease is taken from under a running attempt.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from songserve.api.jobs.states import TrackStatus
from songserve.api.store.members import Fence
from songserve.api.store.protocol import JobStore, LeaseLost, StaleTrack
from tests.support.fake_fleet import FakeFleet, Plan, aio, body, until
from tests.support.stores import lease, new_job, run, running, two_stores


async def lapsed(store: JobStore, worker: int) -> None:
    """Until the worker's lease has expired (on the store's clock): no owner in the registry."""
    while any(r.worker_id == worker and r.lease_owner is not None for r in await store.members.live_workers()):
        await asyncio.sleep(0.02)


def test_the_epoch_stays_while_its_holder_renews_and_grows_when_the_lease_changes_hands(engine: str) -> None:
    async def go() -> None:
        async with two_stores(engine) as s:
            f = await lease(s.a, "A", ttl=0.4)
            assert f.epoch == 1
            assert await s.a.members.acquire_lease("A", 0, ttl=0.4) == 1  # its holder, unexpired: the same epoch
            assert await s.a.members.renew_leases("A", ttl=0.4) == {0: 1}
            await lapsed(s.b, 0)
            assert await s.b.members.acquire_lease("B", 0, ttl=5) == 2  # changed hands
            await s.b.members.release_lease("B", 0)
            assert await s.a.members.acquire_lease("A", 0, ttl=5) == 3  # taken again after it was given back

    run(go)


def test_a_claim_under_a_lease_that_passed_on_is_refused_and_claims_nothing(engine: str) -> None:
    async def go() -> None:
        async with two_stores(engine) as s:
            job = new_job("fence00000000001", tracks=2)
            await s.a.insert_job(job)
            stale = await lease(s.a, "A", ttl=0.3)
            await lapsed(s.b, 0)
            fresh = await lease(s.b, "B", ttl=30)
            with pytest.raises(LeaseLost) as lost:
                await s.a.claim([running(t, "A") for t in job.tracks], stale)
            assert lost.value.fence == stale
            stored = await s.b.load_job(job.job_id)
            assert stored is not None
            assert [t.status for t in stored.tracks] == [TrackStatus.queued] * 2  # nothing claimed
            assert await s.b.claim([running(t, "B") for t in job.tracks], fresh) == {0, 1}

    run(go)


def test_a_write_under_an_expired_lease_is_refused_even_when_nobody_took_it(engine: str) -> None:
    """A paused dispatcher's memory says it holds the lease; the store's clock says it expired."""

    async def go() -> None:
        async with two_stores(engine) as s:
            job = new_job("fence00000000002", tracks=1)
            await s.a.insert_job(job)
            f = await lease(s.a, "A", ttl=0.3)
            mine = running(job.tracks[0], "A")
            assert await s.a.claim([mine], f) == {0}
            await lapsed(s.a, 0)
            done = dataclasses.replace(mine, status=TrackStatus.done, owner=None)
            with pytest.raises(LeaseLost):
                await s.a.save_track(done, (TrackStatus.generating, "A"), f)
            stored = await s.a.load_job(job.job_id)
            assert stored is not None
            assert stored.tracks[0].status is TrackStatus.generating  # untouched
            again = await s.a.members.acquire_lease("A", 0, ttl=30)
            assert again == f.epoch + 1  # re-taken after expiry: a new epoch, even for its last holder
            with pytest.raises(LeaseLost):  # the old epoch stays refused
                await s.a.save_track(done, (TrackStatus.generating, "A"), f)
            await s.a.save_track(done, (TrackStatus.generating, "A"), Fence("A", 0, again))
            stored = await s.a.load_job(job.job_id)
            assert stored is not None
            assert stored.tracks[0].status is TrackStatus.done

    run(go)


def test_a_fence_is_checked_before_the_compare_and_set_and_progress_under_a_lost_lease_changes_nothing(
    engine: str,
) -> None:
    async def go() -> None:
        async with two_stores(engine) as s:
            job = new_job("fence00000000003", tracks=1)
            await s.a.insert_job(job)
            fa = await lease(s.a, "A", ttl=0.3)
            mine = running(job.tracks[0], "A")
            await s.a.claim([mine], fa)
            await lapsed(s.b, 0)
            fb = await lease(s.b, "B", ttl=30)
            # B takes the track over (its owner now B); A's progress and its stale view both fail.
            await s.b.save_track(dataclasses.replace(mine, owner="B"), (TrackStatus.generating, "A"), fb)
            await s.a.save_progress(dataclasses.replace(mine, phase_progress=77), fa)
            with pytest.raises(LeaseLost):  # the lease, not merely the owner, is named
                await s.a.save_track(dataclasses.replace(mine, status=TrackStatus.superres), (mine.status, "A"), fa)
            with pytest.raises(StaleTrack):  # without a fence: only the compare-and-set, which fails too
                await s.a.save_track(dataclasses.replace(mine, status=TrackStatus.superres), (mine.status, "A"))
            stored = await s.b.load_job(job.job_id)
            assert stored is not None
            assert (stored.tracks[0].owner, stored.tracks[0].phase_progress) == ("B", 0)

    run(go)


def test_a_claim_waits_for_a_lease_change_in_flight_and_then_sees_it(pg_url: str) -> None:
    """PostgreSQL: a claim and a take-over never cross. The claim's ``FOR SHARE`` on the lease row waits
    for a concurrent change of that row to commit, then checks the committed row (the new holder's)."""
    import psycopg

    async def go() -> None:
        async with two_stores(pg_url) as s:
            job = new_job("fence00000000004", tracks=1)
            await s.a.insert_job(job)
            fa = await lease(s.a, "A", ttl=30)
            taker = await psycopg.AsyncConnection.connect(pg_url)
            try:
                await taker.execute(
                    "UPDATE workers SET lease_owner='B', lease_epoch=lease_epoch+1, lease_until=lease_until+60"
                    " WHERE worker_id=0"
                )  # B's take-over, not committed yet
                claim = asyncio.ensure_future(s.a.claim([running(job.tracks[0], "A")], fa))
                while True:  # until A's claim waits on B's row lock
                    rows = await (await taker.execute("SELECT count(*) FROM pg_locks WHERE NOT granted")).fetchone()
                    if rows and rows[0] > 0:
                        break
                    assert not claim.done(), claim
                    await asyncio.sleep(0.01)
                await taker.commit()
                with pytest.raises(LeaseLost):
                    await claim
            finally:
                await taker.close()
            stored = await s.a.load_job(job.job_id)
            assert stored is not None
            assert stored.tracks[0].status is TrackStatus.queued

    run(go)


@aio
async def test_an_attempt_whose_lease_is_taken_ends_without_touching_its_track(tmp_path):
    """The lease passes to another dispatcher while a track runs: the worker's answer is not applied,
    not retried, and the track stays as the store has it, for the lease's new holder."""
    async with FakeFleet(tmp_path) as f:
        d, store = f.svc.dispatcher, f.svc.store
        release = asyncio.Event()
        f.workers[0].plans.append(Plan(release=release))
        job_id = (await f.svc.submit(body())).job_id
        await until(lambda: bool(f.workers[0].running))
        # Another dispatcher takes the worker's lease (as after this one stalled past it).
        await store.db.execute(
            "UPDATE workers SET lease_owner='B', lease_epoch=lease_epoch+1, lease_until=?", (time.time() + 600,)
        )
        release.set()
        await until(lambda: not d.attempts.running)
        stored = await store.load_job(job_id)
        assert stored is not None
        assert stored.tracks[0].status is TrackStatus.generating  # not done, not re-queued: B's to reconcile
        assert stored.tracks[0].attempts == 1
        assert f.workers[0].removed == []  # its files stay on the worker for B to collect
        assert len(f.workers[0].generated) == 1
