"""Job stores for the tests: a store at a location of either engine (the integration tier's ``engine``
fixture gives a SQLite file or a fresh PostgreSQL database), two dispatchers' views of one store, and the
records the store's contract tests write."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from songserve.api.jobs.records import Job, Track
from songserve.api.jobs.states import TrackStatus
from songserve.api.store.members import Fence
from songserve.api.store.protocol import JobStore
from songserve.api.store.sqlite.store import SqliteStore
from songserve.schemas import GenerateRequest


async def open_store(where: str, origin: str = "A") -> JobStore:
    if where.startswith("postgresql://"):
        from songserve.api.store.postgres.store import PgStore

        return await PgStore.open(where, origin, pool_size=4)
    return SqliteStore(Path(where))


@dataclasses.dataclass
class Two:
    a: JobStore
    b: JobStore


@asynccontextmanager
async def two_stores(where: str) -> AsyncIterator[Two]:
    """Two dispatchers' views of one store (A and B), closed at the end."""
    s = Two(await open_store(where, "A"), await open_store(where, "B"))
    try:
        yield s
    finally:
        await s.a.close()
        await s.b.close()


def run(coro_fn):  # type: ignore[no-untyped-def]
    asyncio.run(asyncio.wait_for(coro_fn(), 30))


def new_job(job_id: str, tracks: int = 2, key: str | None = None) -> Job:
    return Job(
        job_id=job_id,
        seq=0,
        created_at=time.time(),
        request=GenerateRequest(lyrics="la la", num_tracks=tracks),
        cleaned_lyrics="la la",
        tracks=[Track(job_id, i, seed=10 + i) for i in range(tracks)],
        idempotency_key=key,
    )


def running(t: Track, owner: str, worker: int = 0) -> Track:
    return dataclasses.replace(
        t, status=TrackStatus.generating, owner=owner, worker_id=worker, attempts=1, task_id=f"{t.job_id}-{owner}"
    )


async def lease(store: JobStore, owner: str, worker: int = 0, ttl: float = 60) -> Fence:
    """``owner`` leases worker ``worker`` (registering workers 0…``worker`` first): the fence of its writes."""
    for i in range(worker + 1):
        await store.members.register(f"http://w{i}:1", ttl=60, announced=False)
    epoch = await store.members.acquire_lease(owner, worker, ttl)
    assert epoch is not None
    return Fence(owner, worker, epoch)
