"""The store's connectors: the dialects' SQL in one place, and SQLite's statements off the event loop.

The dialect tests are pure (no loop, no database). The SQLite test holds the file's write lock from
another connection and shows that a write waiting for it leaves the event loop free.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from pathlib import Path

from songserve.api.store.connector import Dialect, marks
from songserve.api.store.postgres.connector import POSTGRESQL
from songserve.api.store.sqlite.connector import SQLITE
from songserve.api.store.sqlite.store import SqliteStore
from tests.support.stores import new_job


def test_a_statement_is_written_once_and_rendered_per_dialect() -> None:
    sql = "UPDATE workers SET until={greatest}(until, {now} + ?) WHERE id=?{for_share}"
    assert SQLITE.render(sql) == f"UPDATE workers SET until=MAX(until, {SQLITE.now} + ?) WHERE id=?"
    assert POSTGRESQL.render(sql) == (
        f"UPDATE workers SET until=GREATEST(until, {POSTGRESQL.now} + %s) WHERE id=%s FOR SHARE"
    )


def test_a_literal_percent_survives_postgresql_placeholders() -> None:
    assert POSTGRESQL.render("SELECT '100%' WHERE a=?") == "SELECT '100%%' WHERE a=%s"
    assert SQLITE.render("SELECT '100%' WHERE a=?") == "SELECT '100%' WHERE a=?"


def test_braces_that_are_not_fields_are_left_alone() -> None:
    sql = "CREATE TABLE t (metadata TEXT NOT NULL DEFAULT '{}')"
    assert SQLITE.render(sql) == sql
    assert POSTGRESQL.render(sql) == sql


def test_a_statement_the_dialects_spell_differently_is_picked_by_name() -> None:
    variants = {"sqlite": "PRAGMA user_version", "postgresql": "SELECT version FROM songserve_schema"}
    assert SQLITE.pick(variants) == "PRAGMA user_version"
    assert POSTGRESQL.pick(variants) == "SELECT version FROM songserve_schema"
    other = Dialect("other", now="now()", greatest="G", skip_locked="", for_share="", placeholder="$")
    assert other.render("{now}?") == "now()$"


def test_marks_make_a_list_of_placeholders() -> None:
    assert marks(3) == "?, ?, ?"
    assert marks(0) == "?"  # never an empty IN ()


def test_a_write_waiting_for_a_busy_file_leaves_the_event_loop_free(tmp_path: Path) -> None:
    path = tmp_path / "jobs.sqlite3"
    store = SqliteStore(path)

    async def go() -> None:
        await store.insert_job(new_job("aaaa000000000010", tracks=1))
        holder = sqlite3.connect(path, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")  # another process holds the write lock
        try:
            write = asyncio.create_task(store.mark_cancelled("aaaa000000000010"))
            ticks = 0
            while ticks < 20:  # the loop keeps running while the write waits in the store's thread
                await asyncio.sleep(0.01)
                ticks += 1
            assert not write.done()
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        await write
        assert await store.is_cancelled("aaaa000000000010")
        threads = {t.name for t in threading.enumerate()}
        assert any(name.startswith("sqlite-store") for name in threads)
        await store.close()

    asyncio.run(asyncio.wait_for(go(), 30))
