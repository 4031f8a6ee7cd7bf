"""The job store's uploaded adapters, the same tests on both engines (SQLite and a real PostgreSQL server):
a row one dispatcher stored is read at another, a name is taken once whichever dispatcher a second
upload came to, a key's uploads are counted by its name, and a deleted row is gone for all."""

from __future__ import annotations

from songserve.api.store.adapters import AdapterRecord
from tests.support.stores import run, two_stores


def adapter(name: str, caller: str | None = "studio") -> AdapterRecord:
    return AdapterRecord(name, caller, 4096, "ab" * 32, 8, ["linear_qkv", "linear_fc1"], 1700000000.5)


def test_an_adapter_stored_at_one_dispatcher_is_read_at_another_and_its_name_is_taken_once(engine: str) -> None:
    async def go() -> None:
        async with two_stores(engine) as s:
            assert await s.a.adapters.insert(adapter("house"))
            assert not await s.b.adapters.insert(adapter("house", "other"))
            assert await s.b.adapters.load("house") == adapter("house")
            assert await s.b.adapters.load("none") is None

    run(go)


def test_a_keys_uploads_are_counted_by_its_name_and_a_delete_is_seen_by_all(engine: str) -> None:
    async def go() -> None:
        async with two_stores(engine) as s:
            for name, caller in (("a1", "studio"), ("a2", "studio"), ("b1", "other"), ("n1", None)):
                assert await s.a.adapters.insert(adapter(name, caller))
            assert await s.b.adapters.count_by("studio") == 2
            assert await s.b.adapters.count_by(None) == 1
            assert await s.b.adapters.delete("a1")
            assert not await s.a.adapters.delete("a1")
            assert [a.name for a in await s.a.adapters.all()] == ["a2", "b1", "n1"]

    run(go)
