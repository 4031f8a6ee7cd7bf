"""The job store's contract, the same tests on both engines (SQLite and a real PostgreSQL server).

What several dispatchers rely on: a queued track is claimed once, a stale write is refused, a job is
finished only when all its tracks are, worker leases are exclusive and expire, the registry gives a
worker one id per URL, and (PostgreSQL) changes are announced to the other dispatchers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import pytest

from songserve.api.jobs.states import TrackStatus
from songserve.api.store.protocol import (
    BACKGROUND,
    DuplicateKey,
    StaleTrack,
    StoreError,
    background_context,
)
from songserve.api.store.sqlite.store import SqliteStore
from songserve.schemas import GenerateRequest
from tests.support.stores import lease, new_job, open_store, run, running, two_stores


def test_a_queued_track_is_claimed_by_exactly_one_dispatcher(engine: str) -> None:
    async def go() -> None:
        async with two_stores(engine) as s:
            job = new_job("aaaa000000000001", tracks=4)
            await s.a.insert_job(job)
            assert job.seq >= 1
            fa, fb = await lease(s.a, "A", 0), await lease(s.b, "B", 1)
            # Both claim all four at once, in opposite orders: every track is won once.
            wins = await asyncio.gather(
                s.a.claim([running(t, "A", 0) for t in job.tracks], fa),
                s.b.claim([running(t, "B", 1) for t in reversed(job.tracks)], fb),
            )
            assert wins[0] | wins[1] == {0, 1, 2, 3}
            assert not wins[0] & wins[1]
            loaded = await s.b.load_job(job.job_id)
            assert loaded is not None
            for t in loaded.tracks:
                assert t.owner == ("A" if t.index in wins[0] else "B")
            # A claim of tracks no longer queued wins nothing.
            assert await s.a.claim([running(t, "A") for t in job.tracks], fa) == set()

    run(go)


def test_a_write_from_a_stale_view_is_refused(engine: str) -> None:
    async def go() -> None:
        async with two_stores(engine) as s:
            job = new_job("aaaa000000000002", tracks=1)
            await s.a.insert_job(job)
            t = job.tracks[0]
            assert await s.a.claim([running(t, "A")], await lease(s.a, "A")) == {0}
            # B still believes the track queued: its cancel is refused, A's progress stays.
            with pytest.raises(StaleTrack):
                await s.b.save_track(dataclasses.replace(t, status=TrackStatus.cancelled), (TrackStatus.queued, None))
            mine = running(t, "A")
            await s.a.save_track(dataclasses.replace(mine, status=TrackStatus.superres), (TrackStatus.generating, "A"))
            loaded = await s.b.load_job(job.job_id)
            assert loaded is not None
            assert loaded.tracks[0].status is TrackStatus.superres

    run(go)


def test_a_job_is_finished_only_when_every_track_ended(engine: str) -> None:
    async def go() -> None:
        async with two_stores(engine) as s:
            job = new_job("aaaa000000000003", tracks=2)
            await s.a.insert_job(job)
            t0, t1 = job.tracks
            fa, fb = await lease(s.a, "A", 0), await lease(s.b, "B", 1)
            await s.a.claim([running(t0, "A")], fa)
            await s.b.claim([running(t1, "B", 1)], fb)
            done0 = dataclasses.replace(running(t0, "A"), status=TrackStatus.done, owner=None)
            await s.a.save_track(done0, (TrackStatus.generating, "A"), fa)
            assert not await s.a.finish_job(job.job_id, time.time())
            done1 = dataclasses.replace(running(t1, "B", 1), status=TrackStatus.error, owner=None, error="boom")
            await s.b.save_track(done1, (TrackStatus.generating, "B"), fb)
            assert await s.b.finish_job(job.job_id, 123.0)
            assert await s.a.active_jobs() == []
            assert await s.a.expired_jobs(124.0) == [job.job_id]
            assert await s.a.counts() == {"done": 1, "error": 1}
            await s.a.delete_job(job.job_id)
            assert await s.b.load_job(job.job_id) is None

    run(go)


def test_an_idempotency_key_names_one_job_across_dispatchers(engine: str) -> None:
    async def go() -> None:
        async with two_stores(engine) as s:
            await s.a.insert_job(new_job("aaaa000000000004", key="k-1"))
            with pytest.raises(DuplicateKey) as dup:
                await s.b.insert_job(new_job("bbbb000000000004", key="k-1"))
            assert dup.value.job_id == "aaaa000000000004"
            assert await s.b.job_by_key("k-1") == "aaaa000000000004"
            assert await s.b.load_job("bbbb000000000004") is None  # nothing of the refused job was stored

    run(go)


def test_jobs_are_listed_newest_first_per_key_and_paged_below_a_sequence(engine: str) -> None:
    async def go() -> None:
        async with two_stores(engine) as s:
            for i, (store, caller) in enumerate([(s.a, "ann"), (s.b, "ben"), (s.a, "ann"), (s.b, None), (s.a, "ann")]):
                job = dataclasses.replace(new_job(f"cccc00000000000{i}", tracks=1), caller=caller)
                await store.insert_job(job)
            every = await s.b.jobs_newest_first(None, None, 10)
            assert [j for j, _ in every] == [f"cccc00000000000{i}" for i in (4, 3, 2, 1, 0)]
            assert [seq for _, seq in every] == sorted((seq for _, seq in every), reverse=True)
            ann = await s.b.jobs_newest_first("ann", None, 2)
            assert [j for j, _ in ann] == ["cccc000000000004", "cccc000000000002"]
            rest = await s.a.jobs_newest_first("ann", ann[-1][1], 2)  # the page below the last one seen
            assert [j for j, _ in rest] == ["cccc000000000000"]
            assert await s.a.jobs_newest_first("nobody", None, 5) == []

    run(go)


def test_worker_leases_are_exclusive_renewed_and_expire(engine: str) -> None:
    async def go() -> None:
        async with two_stores(engine) as s:
            w0 = await s.a.members.register("http://w0:1", ttl=60, announced=False)
            w1 = await s.b.members.register("http://w1:1", ttl=60, announced=True)
            assert await s.b.members.register("http://w0:1", ttl=60, announced=False) == w0  # one id per URL
            assert (w0, w1) == (0, 1)
            assert await s.a.members.acquire_lease("A", w0, ttl=0.6) == 1  # the first holder: epoch 1
            assert await s.b.members.acquire_lease("B", w0, ttl=0.6) is None
            assert await s.a.members.acquire_lease("A", w0, ttl=0.6) == 1  # its own: renewed, same epoch
            assert await s.a.members.renew_leases("A", ttl=0.6) == {w0: 1}
            rows = {r.worker_id: r for r in await s.b.members.live_workers()}
            assert rows[w0].lease_owner == "A"
            assert rows[w1].announced
            await asyncio.sleep(0.8)  # A stops renewing: its lease expires
            assert await s.a.members.renew_leases("A", ttl=0.6) == {}
            assert await s.b.members.acquire_lease("B", w0, ttl=5) == 2  # changed hands: a new epoch
            assert await s.a.members.acquire_lease("A", w0, ttl=5) is None
            await s.b.members.leave("B")  # a dispatcher that stops gives its leases back at once
            assert await s.a.members.acquire_lease("A", w0, ttl=5) == 3
            assert await s.a.members.withdraw(w1)
            assert not await s.a.members.withdraw(w1)
            assert [r.worker_id for r in await s.a.members.live_workers()] == [w0]
            assert not await s.b.members.acquire_lease("B", w1, ttl=5)  # not registered any more

    run(go)


def test_live_dispatchers_are_those_that_kept_their_heartbeat(engine: str) -> None:
    async def go() -> None:
        async with two_stores(engine) as s:
            assert await s.a.members.heartbeat("A", ttl=0.5) == {"A"}
            assert await s.b.members.heartbeat("B", ttl=5) == {"A", "B"}
            await asyncio.sleep(0.7)
            assert await s.b.members.heartbeat("B", ttl=5) == {"B"}

    run(go)


def test_running_tracks_are_found_by_their_worker(engine: str) -> None:
    async def go() -> None:
        async with two_stores(engine) as s:
            job = new_job("aaaa000000000005", tracks=3)
            await s.a.insert_job(job)
            f7, f8 = await lease(s.a, "A", 7), await lease(s.a, "A", 8)
            await s.a.claim([running(job.tracks[0], "A", worker=7), running(job.tracks[2], "A", worker=7)], f7)
            await s.a.claim([running(job.tracks[1], "A", worker=8)], f8)
            assert sorted(await s.b.running_on(7)) == [(job.job_id, 0), (job.job_id, 2)]

    run(go)


def test_changes_at_one_dispatcher_are_heard_by_the_others(pg_url: str) -> None:
    """PostgreSQL only: every write NOTIFYs; a dispatcher does not hear its own; one sweeper at a time."""

    async def go() -> None:
        async with two_stores(pg_url) as s:
            heard_a: list[str] = []
            heard_b: list[str] = []
            async with s.a.listen(heard_a.append), s.b.listen(heard_b.append):
                while "*" not in heard_b or "*" not in heard_a:  # each listener says it (re)started
                    await asyncio.sleep(0.01)
                job = new_job("aaaa000000000006", tracks=1)
                await s.a.insert_job(job)
                await s.a.claim([running(job.tracks[0], "A")], await lease(s.a, "A"))
                while heard_b.count(job.job_id) < 2:
                    await asyncio.sleep(0.01)
                assert job.job_id not in heard_a
            async with s.a.exclusive("retention") as a_got, s.b.exclusive("retention") as b_got:
                assert (a_got, b_got) == (True, False)
            async with s.b.exclusive("retention") as b_got:
                assert b_got

    run(go)


def test_reads_after_a_database_restart_use_fresh_connections(pg_server, pg_url: str) -> None:
    """A restart leaves every pooled connection dead. The first failure has the pool test and replace
    them all, and a read that met a dead connection is tried once more: no read fails after the server
    is back (without that, a GET /job answers 503 on the second of several stale connections)."""
    from songserve.api.store.postgres.store import PgStore

    async def body() -> None:
        store = await PgStore.open(pg_url, "A", pool_size=4)
        try:
            await store.insert_job(new_job("r1"))
            await asyncio.gather(*(store.load_job("r1") for _ in range(8)))  # fill the pool
            assert store.db.routes.pool.get_stats()["pool_size"] >= 2
            pg_server.pause()
            with pytest.raises(StoreError):  # down: a read answers (503 at the HTTP layer), it does not hang
                await store.load_job("r1")
            pg_server.resume()
            for _ in range(6):  # more reads than the pool has connections, one after another
                job = await store.load_job("r1")
                assert job is not None
                assert job.job_id == "r1"
        finally:
            if not pg_server.running:
                pg_server.resume()
            await store.close()

    asyncio.run(asyncio.wait_for(body(), 60))


def test_both_engines_walk_the_same_schema_versions() -> None:
    """Each engine writes its steps in its own SQL, sharing only ``store/migrations.py``: the steps'
    numbers and purposes must agree, or a store moved between engines would mean different things."""
    from songserve.api.store.postgres import migrations as pg
    from songserve.api.store.sqlite import migrations as sqlite

    assert [(m.version, m.what) for m in pg.MIGRATIONS] == [(m.version, m.what) for m in sqlite.MIGRATIONS]
    assert pg.SCHEMA_VERSION == sqlite.SCHEMA_VERSION


def test_an_older_store_is_brought_forward_with_its_rows_by_the_one_runner(engine: str) -> None:
    """A store left at schema version 4 (before webhooks, keys and uploads) by an older build opens:
    the one runner applies 5 to 7 on either engine, and the job stored before is read back whole."""
    from songserve.api.store.migrations import migrate

    old_job = (
        "INSERT INTO jobs (job_id, created_at, request, cleaned_lyrics, num_tracks) VALUES (?, 1, ?, 'la', 1)",
        ("aaaa000000000020", GenerateRequest(lyrics="la").model_dump_json()),
    )
    old_track = ("INSERT INTO tracks (job_id, idx, status, seed) VALUES (?, 0, 'queued', 7)", ("aaaa000000000020",))

    async def go() -> None:
        if engine.startswith("postgresql://"):
            import psycopg
            from psycopg.rows import dict_row

            from songserve.api.store.postgres import migrations as pg
            from songserve.api.store.postgres.connector import PgSession

            async with await psycopg.AsyncConnection.connect(engine, autocommit=True, row_factory=dict_row) as c:
                session = PgSession(c, "A")
                assert await migrate(session, pg.MIGRATIONS[:4]) == [1, 2, 3, 4]
                async with session.transaction() as tx:
                    await tx.execute(*old_job)
                    await tx.execute(*old_track)
        else:
            from songserve.api.store.sqlite import migrations as lite
            from songserve.api.store.sqlite.connector import SqliteConnector

            conn = SqliteConnector(Path(engine))
            assert await migrate(conn, lite.MIGRATIONS[:4]) == [1, 2, 3, 4]
            async with conn.transaction() as tx:
                await tx.execute(
                    old_job[0].replace("(job_id,", "(seq, job_id,").replace("VALUES (", "VALUES (1, "), old_job[1]
                )
                await tx.execute(*old_track)
            await conn.close()
        store = await open_store(engine)
        try:
            job = await store.load_job("aaaa000000000020")
            assert job is not None
            assert (job.caller, job.tracks[0].seed, job.tracks[0].status) == (None, 7, TrackStatus.queued)
            assert await store.uploads.ids() == set()  # the uploads table of version 6 exists
            later = new_job("aaaa000000000021", tracks=1)
            await store.insert_job(later)
            assert later.seq == 2
        finally:
            await store.close()

    run(go)


def test_a_transaction_left_idle_by_a_paused_dispatcher_is_ended_by_the_server(pg_url: str) -> None:
    """A dispatcher stopped between two statements of a transaction holds its row locks no longer than
    the statement timeout: the server ends its session, the lock is free for the others, and the
    paused one meets a dead connection when it resumes."""
    import psycopg

    from songserve.api.store.postgres.conn import StoreLimits

    options = StoreLimits(statement_timeout_sec=0.5).options(pg_url)
    patient = StoreLimits(statement_timeout_sec=10.0, lock_timeout_sec=10.0).options(pg_url)
    with psycopg.connect(pg_url, autocommit=True) as setup:
        setup.execute("CREATE TABLE IF NOT EXISTS idle_probe (id int PRIMARY KEY, v int)")
        setup.execute("INSERT INTO idle_probe VALUES (1, 0) ON CONFLICT (id) DO NOTHING")
    with psycopg.connect(pg_url, options=options) as paused, psycopg.connect(pg_url, options=patient) as other:
        paused.execute("UPDATE idle_probe SET v = v + 1 WHERE id = 1")  # the row is locked; then nothing is sent
        other.autocommit = True
        other.execute("UPDATE idle_probe SET v = v + 10 WHERE id = 1")  # waits until the server ends the other
        with pytest.raises(psycopg.Error, match="idle-in-transaction timeout"):
            paused.execute("SELECT 1")
        assert other.execute("SELECT v FROM idle_probe WHERE id = 1").fetchone() == (10,)  # its update was rolled back


def test_a_lease_renewal_is_not_queued_behind_a_burst_of_submissions(tmp_path: Path) -> None:
    """SQLite has one connection: the background lane (leases, the probe) goes before the routes' queue."""

    async def scenario() -> None:
        store = SqliteStore(tmp_path / "jobs.sqlite3")
        try:
            token = BACKGROUND.set(True)
            try:
                await lease(store, "A")
            finally:
                BACKGROUND.reset(token)
            done: list[str] = []

            async def submit(i: int) -> None:
                await store.insert_job(new_job(f"burst{i:04d}"))
                done.append(f"burst{i:04d}")

            burst = [asyncio.create_task(submit(i)) for i in range(300)]
            await asyncio.sleep(0.05)  # the burst has queued on the connection

            async def renew() -> None:
                await store.members.renew_leases("A", 60)
                await store.probe(1.0)

            await asyncio.create_task(renew(), context=background_context())
            submitted_before = len(done)
            await asyncio.gather(*burst)
            assert submitted_before < 150, f"the renewal waited for {submitted_before} of 300 submissions"
            assert len(await store.job_ids()) == 300
        finally:
            await store.close()

    run(scenario)
