"""The SQLite connector's two-lane lock: the background lane is served first, each lane in order, and a
waiter cancelled at any moment neither keeps the lock nor loses another waiter's turn."""

from __future__ import annotations

import asyncio

import pytest

from songserve.api.store.sqlite.connector import LaneLock


async def _holder(lock: LaneLock, first: bool, name: str, order: list[str]) -> None:
    async with lock.hold(first):
        order.append(name)
        await asyncio.sleep(0)


def test_background_waiters_go_before_route_waiters_each_lane_in_order() -> None:
    async def scenario() -> list[str]:
        lock, order = LaneLock(), []
        await lock.acquire(first=False)
        tasks = [
            asyncio.create_task(_holder(lock, first, name, order))
            for first, name in [(False, "r1"), (True, "b1"), (False, "r2"), (True, "b2")]
        ]
        await asyncio.sleep(0)  # all four queued
        lock.release()
        await asyncio.gather(*tasks)
        assert not lock.locked()
        return order

    assert asyncio.run(scenario()) == ["b1", "b2", "r1", "r2"]


def test_a_cancelled_waiter_leaves_the_lock_to_the_next() -> None:
    async def scenario() -> list[str]:
        lock, order = LaneLock(), []
        await lock.acquire(first=False)
        gone = asyncio.create_task(_holder(lock, True, "gone", order))
        kept = asyncio.create_task(_holder(lock, False, "kept", order))
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.sleep(0)
        lock.release()
        await kept
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert not lock.locked()
        return order

    assert asyncio.run(scenario()) == ["kept"]


def test_a_waiter_cancelled_just_as_it_was_handed_the_lock_passes_it_on() -> None:
    async def scenario() -> list[str]:
        lock, order = LaneLock(), []
        await lock.acquire(first=False)
        handed = asyncio.create_task(lock.acquire(first=True))
        after = asyncio.create_task(_holder(lock, False, "after", order))
        await asyncio.sleep(0)
        lock.release()  # hands the lock to ``handed``, which has not run yet
        handed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await handed
        await after
        assert not lock.locked()
        return order

    assert asyncio.run(scenario()) == ["after"]


def test_releasing_a_free_lock_is_an_error() -> None:
    with pytest.raises(RuntimeError):
        LaneLock().release()
