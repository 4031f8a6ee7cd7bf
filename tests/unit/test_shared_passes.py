"""One dispatch pass answers every call made before it began (``api/dispatch/loops.py:SharedPasses``):
a burst of callers waits for the pass under way and one more, and none returns before its change was seen."""

from __future__ import annotations

import asyncio

import pytest

from songserve.api.dispatch.loops import SharedPasses


def test_fifty_calls_during_a_pass_share_one_more_pass_and_each_saw_its_change() -> None:
    async def main() -> tuple[int, list[bool]]:
        changes: list[int] = []  # what callers changed, in order
        seen_upto = 0  # how many changes the last finished pass saw
        release = asyncio.Event()

        async def body() -> None:
            nonlocal seen_upto
            upto = len(changes)  # a pass sees what was changed before it began
            await release.wait()
            seen_upto = upto

        passes = SharedPasses(body)

        async def caller(n: int) -> bool:
            changes.append(n)
            await passes()
            return seen_upto > changes.index(n)  # the pass it waited for began after its change

        first = asyncio.create_task(caller(0))
        await asyncio.sleep(0)  # the first pass is under way and waits
        rest = [asyncio.create_task(caller(n)) for n in range(1, 50)]
        await asyncio.sleep(0)
        release.set()
        results = await asyncio.gather(first, *rest)
        return passes.passes, results

    runs, saw = asyncio.run(main())
    assert runs == 2  # the pass under way, and one for the 49 that came during it
    assert all(saw)


def test_a_pass_that_raises_covers_nobody() -> None:
    async def main() -> int:
        calls = 0

        async def body() -> None:
            nonlocal calls
            calls += 1
            await asyncio.sleep(0)
            if calls == 1:
                raise RuntimeError("the store went away")

        passes = SharedPasses(body)
        first = asyncio.create_task(passes())
        await asyncio.sleep(0)
        second = asyncio.create_task(passes())
        with pytest.raises(RuntimeError):
            await first
        await second  # it ran a pass of its own: the failed one saw nothing for it
        return calls

    assert asyncio.run(main()) == 2


def test_calls_one_after_another_each_run_a_pass() -> None:
    async def main() -> int:
        async def body() -> None:
            await asyncio.sleep(0)

        passes = SharedPasses(body)
        for _ in range(3):
            await passes()
        return passes.passes

    assert asyncio.run(main()) == 3
