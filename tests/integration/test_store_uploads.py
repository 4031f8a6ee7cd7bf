"""The job store's uploads, the same tests on both engines (SQLite and a real PostgreSQL server).

What the dispatchers of a fleet rely on: any of them reads an upload another stored; one of them
encodes it (a claim fenced by the worker's lease, won once); only its encoder writes its end; what
a dead dispatcher left encoding goes back to the queue; retention sees finished uploads beside jobs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import pytest

from songserve.api.jobs.states import TrackStatus
from songserve.api.store.members import Fence
from songserve.api.store.uploads import UploadRecord
from songserve.schemas import UploadStatus
from tests.support.stores import lease, new_job, run, two_stores


@pytest.fixture(params=["sqlite", "postgresql"])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The store location for the engine: a file, or a fresh PostgreSQL database (as test_store_engines.py)."""
    if request.param == "sqlite":
        return str(tmp_path / "jobs.sqlite3")
    return str(request.getfixturevalue("pg_url"))


def upload(upload_id: str, created: float | None = None) -> UploadRecord:
    return UploadRecord(
        upload_id=upload_id,
        created_at=time.time() if created is None else created,
        status=UploadStatus.queued,
        filename="demo.wav",
        ext="wav",
        bytes=1234,
        duration_sec=8.0,
        frames=172,
        source={"format": "WAV", "sample_rate": 44100, "channels": 2},
    )


def test_an_upload_stored_at_one_dispatcher_is_read_at_another(engine: str) -> None:
    async def go() -> None:
        async with two_stores(engine) as s:
            await s.a.uploads.insert(upload("abcd000000000001"))
            got = await s.b.uploads.load("abcd000000000001")
            assert got == upload("abcd000000000001", created=got.created_at if got else 0)
            assert await s.b.uploads.load("abcd00000000ffff") is None
            assert [u.upload_id for u in await s.b.uploads.queued(5)] == ["abcd000000000001"]
            assert await s.a.uploads.ids() == {"abcd000000000001"}
            assert await s.b.uploads.counts() == {"queued": 1}

    run(go)


def test_an_upload_is_claimed_once_under_a_held_lease_and_only_its_encoder_ends_it(engine: str) -> None:
    async def go() -> None:
        async with two_stores(engine) as s:
            await s.a.uploads.insert(upload("abcd000000000002"))
            fa, fb = await lease(s.a, "A", 0), await lease(s.b, "B", 1)
            wins = await asyncio.gather(
                s.a.uploads.claim("abcd000000000002", fa), s.b.uploads.claim("abcd000000000002", fb)
            )
            assert sorted(wins) == [False, True]
            winner, loser = ("A", "B") if wins[0] else ("B", "A")
            u = await s.a.uploads.load("abcd000000000002")
            assert u is not None
            assert (u.status, u.owner, u.attempts) == (UploadStatus.encoding, winner, 1)
            assert await s.a.uploads.queued(5) == []
            done = dataclasses.replace(u, status=UploadStatus.ready, frames=171, finished_at=time.time())
            assert not await s.a.uploads.finish(done, loser)  # not its encoder: nothing written
            assert await s.a.uploads.finish(done, winner)
            got = await s.b.uploads.load("abcd000000000002")
            assert got is not None
            assert (got.status, got.frames, got.owner) == (UploadStatus.ready, 171, None)
            assert not await s.a.uploads.finish(done, winner)  # once
            # A lease not held claims nothing.
            await s.a.uploads.insert(upload("abcd000000000003"))
            assert not await s.a.uploads.claim("abcd000000000003", Fence("A", 0, fa.epoch + 5))

    run(go)


def test_an_encoding_goes_back_to_the_queue_counted_or_not(engine: str) -> None:
    async def go() -> None:
        async with two_stores(engine) as s:
            await s.a.uploads.insert(upload("abcd000000000004"))
            fa = await lease(s.a, "A", 0)
            assert await s.a.uploads.claim("abcd000000000004", fa)
            assert await s.a.uploads.requeue("abcd000000000004", "A", "worker busy", count=False)
            u = await s.a.uploads.load("abcd000000000004")
            assert u is not None
            assert (u.status, u.attempts, u.error, u.owner) == (UploadStatus.queued, 0, "worker busy", None)
            assert await s.a.uploads.claim("abcd000000000004", fa)
            assert not await s.b.uploads.requeue("abcd000000000004", "B", "not mine")
            assert await s.a.uploads.requeue("abcd000000000004", "A", "worker lost")
            u = await s.a.uploads.load("abcd000000000004")
            assert u is not None
            assert (u.status, u.attempts) == (UploadStatus.queued, 1)

    run(go)


def test_what_a_dead_dispatcher_or_a_restart_left_encoding_is_queued_again(engine: str) -> None:
    async def go() -> None:
        async with two_stores(engine) as s:
            fa, fb = await lease(s.a, "A", 0), await lease(s.b, "B", 1)
            for i, f in ((5, fa), (6, fb), (7, fa)):
                await s.a.uploads.insert(upload(f"abcd00000000000{i}"))
                assert await s.a.uploads.claim(f"abcd00000000000{i}", f)
            # A restarted: its attempt of 7 runs, that of 5 is gone; B is alive.
            assert await s.a.uploads.requeue_stale({"A", "B"}, "A", {"abcd000000000007"}) == 1
            # B died: its encoding goes back too, whoever notices.
            assert await s.a.uploads.requeue_stale({"A"}, "A", {"abcd000000000007"}) == 1
            states = {u: (await s.a.uploads.load(u)).status for u in await s.a.uploads.ids()}  # type: ignore[union-attr]
            assert states == {
                "abcd000000000005": "queued",
                "abcd000000000006": "queued",
                "abcd000000000007": "encoding",
            }

    run(go)


def test_finished_uploads_expire_and_line_up_with_jobs_oldest_first(engine: str) -> None:
    async def go() -> None:
        async with two_stores(engine) as s:
            job = new_job("aaaa0000000000aa", tracks=1)
            await s.a.insert_job(job)
            fa = await lease(s.a, "A", 0)
            for i, at in ((8, 100.0), (9, 300.0)):
                await s.a.uploads.insert(upload(f"abcd00000000000{i}"))
                assert await s.a.uploads.claim(f"abcd00000000000{i}", fa)
                u = await s.a.uploads.load(f"abcd00000000000{i}")
                assert u is not None
                assert await s.a.uploads.finish(
                    dataclasses.replace(u, status=UploadStatus.failed, error="x", finished_at=at), "A"
                )
            done = dataclasses.replace(job.tracks[0], status=TrackStatus.done)
            await s.a.save_track(done, (job.tracks[0].status, None))
            assert await s.a.finish_job(job.job_id, 200.0)
            assert await s.a.uploads.expired(250.0) == ["abcd000000000008"]
            assert await s.b.uploads.finished_oldest_first() == [
                ("upload", "abcd000000000008"),
                ("job", job.job_id),
                ("upload", "abcd000000000009"),
            ]
            assert await s.b.uploads.delete("abcd000000000008")
            assert not await s.b.uploads.delete("abcd000000000008")
            assert await s.a.uploads.load("abcd000000000008") is None

    run(go)


def test_retention_removes_uploads_past_their_ttl_over_the_cap_and_orphaned(tmp_path: Path) -> None:
    import os

    from songserve.api.results.artifacts import ArtifactStore
    from songserve.api.results.retention import Retention
    from songserve.api.store.sqlite.store import SqliteStore

    async def go() -> None:
        store = SqliteStore(tmp_path / "jobs.sqlite3")
        artifacts = ArtifactStore(tmp_path / "results")
        fence = await lease(store, "A", 0)
        for i, finished in ((1, 100.0), (2, 5_000.0), (3, 9_000.0)):
            u = upload(f"eeee00000000000{i}")
            await store.uploads.insert(u)
            artifacts.write_upload(u.upload_id, "source.wav", b"x" * 600_000)
            assert await store.uploads.claim(u.upload_id, fence)
            assert await store.uploads.finish(
                dataclasses.replace(u, status=UploadStatus.ready, finished_at=finished), "A"
            )
        await store.uploads.insert(upload("eeee000000000009"))  # queued: never a candidate
        artifacts.write_upload("eeee000000000009", "source.wav", b"x" * 600_000)
        artifacts.write_upload("eeee00000000000f", "source.wav", b"orphan")  # a folder no row owns
        old = time.time() - 3600
        os.utime(tmp_path / "results" / "uploads" / "eeee00000000000f", (old, old))
        retention = Retention(store, artifacts, ttl_sec=1_000.0, max_mb=1.5)  # 2.4 MB stored, 1.5 MB allowed
        assert (
            await retention.sweep(now=2_000.0) == 3
        )  # 1 past its TTL; then 2, the oldest left, over the cap; the orphan
        assert await store.uploads.ids() == {"eeee000000000003", "eeee000000000009"}
        assert sorted(p.name for p in (tmp_path / "results" / "uploads").iterdir()) == [
            "eeee000000000003",
            "eeee000000000009",
        ]
        await store.close()

    run(go)
