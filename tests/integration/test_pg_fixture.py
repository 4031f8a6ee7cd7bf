"""The throw-away PostgreSQL server answers, and the PostgreSQL features the job store relies on behave as it
expects across connections: commits visible to others, LISTEN/NOTIFY, ``FOR UPDATE SKIP LOCKED`` (also in the
claim query's shape: a window-function subquery joined to the locked table), advisory locks, an async pool.
"""

from __future__ import annotations

import asyncio

import psycopg
import pytest
from psycopg import errors


def test_server_answers_with_a_fresh_database(pg_url):
    with psycopg.connect(pg_url) as conn:
        version = conn.execute("SHOW server_version_num").fetchone()[0]
        db = conn.execute("SELECT current_database()").fetchone()[0]
        tables = conn.execute("SELECT count(*) FROM information_schema.tables WHERE table_schema = 'public'").fetchone()
        fsync = conn.execute("SHOW fsync").fetchone()[0]
        max_conn = int(conn.execute("SHOW max_connections").fetchone()[0])
    assert int(version) >= 130000  # DROP DATABASE … WITH (FORCE) needs 13
    assert pg_url.endswith("/" + db)
    assert db.startswith("t_")
    assert tables == (0,)
    assert fsync == "off"
    assert max_conn >= 200


def test_each_database_is_separate_and_dropped(pg_server):
    a, b = pg_server.create_database(), pg_server.create_database()
    assert a != b
    with psycopg.connect(pg_server.url(a), autocommit=True) as conn:
        conn.execute("CREATE TABLE only_in_a (x int)")
    with psycopg.connect(pg_server.url(b)) as conn:
        assert conn.execute("SELECT to_regclass('only_in_a')").fetchone() == (None,)
    held = psycopg.connect(pg_server.url(a))  # a process a test left behind: the drop must still work
    pg_server.drop_database(a)
    pg_server.drop_database(b)
    with pytest.raises(psycopg.OperationalError, match=a):
        psycopg.connect(pg_server.url(a))
    held.close()


def test_commits_are_seen_by_another_connection_and_uncommitted_rows_are_not(pg_url):
    with psycopg.connect(pg_url) as a, psycopg.connect(pg_url, autocommit=True) as b:
        a.execute("CREATE TABLE jobs (id text PRIMARY KEY)")
        a.commit()
        a.execute("INSERT INTO jobs VALUES ('j1')")
        assert b.execute("SELECT id FROM jobs").fetchall() == []  # not yet committed
        a.commit()
        assert b.execute("SELECT id FROM jobs").fetchall() == [("j1",)]
        b.execute("INSERT INTO jobs VALUES ('j2')")
        assert a.execute("SELECT id FROM jobs ORDER BY id").fetchall() == [("j1",), ("j2",)]


def test_listen_notify_crosses_connections(pg_url):
    with psycopg.connect(pg_url, autocommit=True) as listener, psycopg.connect(pg_url) as sender:
        listener.execute("LISTEN track_events")
        sender.execute("SELECT pg_notify('track_events', 'job-1:0:running')")
        assert list(listener.notifies(timeout=0.2, stop_after=1)) == []  # delivered only on commit
        sender.commit()
        got = list(listener.notifies(timeout=10, stop_after=1))
    assert [(n.channel, n.payload) for n in got] == [("track_events", "job-1:0:running")]


def _queue(conn: psycopg.Connection) -> None:
    conn.execute("CREATE TABLE tracks (id int PRIMARY KEY, client text, priority int, status text)")
    conn.execute(
        "INSERT INTO tracks VALUES (1, 'a', 0, 'queued'), (2, 'a', 0, 'queued'), (3, 'b', 0, 'queued'),"
        " (4, 'b', 1, 'queued'), (5, 'c', 0, 'running')"
    )
    conn.commit()


def test_for_update_skip_locked_skips_a_row_another_transaction_holds(pg_url):
    claim = "SELECT id FROM tracks WHERE status = 'queued' ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED"
    with psycopg.connect(pg_url) as a, psycopg.connect(pg_url) as b:
        _queue(a)
        assert a.execute(claim).fetchone() == (1,)  # A holds row 1 until it commits
        assert b.execute(claim).fetchone() == (2,)  # B does not wait: it takes the next row
        with pytest.raises(errors.LockNotAvailable):  # the lock is real: NOWAIT on row 1 fails
            b.execute("SELECT id FROM tracks WHERE id = 1 FOR UPDATE NOWAIT")
        b.rollback()
        a.execute("UPDATE tracks SET status = 'running' WHERE id = 1")
        a.commit()
        assert b.execute(claim).fetchone() == (2,)  # B's own lock was released by its rollback


# The claim query's shape: fairness rank from a window function over the queued rows, joined back to the
# table whose row is locked; FOR UPDATE OF names only that table (the subquery itself cannot be locked).
RANKED_CLAIM = """
SELECT t.id
FROM tracks t
JOIN (
    SELECT id, row_number() OVER (PARTITION BY client ORDER BY priority DESC, id) AS rank
    FROM tracks WHERE status = 'queued'
) r ON r.id = t.id
WHERE t.status = 'queued'
ORDER BY r.rank, t.priority DESC, t.id
LIMIT 1
FOR UPDATE OF t SKIP LOCKED
"""


def test_window_function_subquery_with_for_update_of_skip_locked_is_accepted(pg_url):
    with psycopg.connect(pg_url) as a, psycopg.connect(pg_url) as b, psycopg.connect(pg_url) as c:
        _queue(a)
        # rank 1 per client: a→1, b→4 (priority 1); ties on rank broken by priority, so 4 first, then 1.
        assert a.execute(RANKED_CLAIM).fetchone() == (4,)
        assert b.execute(RANKED_CLAIM).fetchone() == (1,)
        # Both rank-1 rows are locked: the next best comes out (rank 2: a→2, b→3; equal priority, so 2), not a
        # wait and not a locked row. The ranks are computed over locked rows too: skipping does not re-rank.
        assert c.execute(RANKED_CLAIM).fetchone() == (2,)
        # Without OF t the lock would reach the window-function subquery, which PostgreSQL refuses.
        c.rollback()
        with pytest.raises(errors.FeatureNotSupported, match="window functions"):
            c.execute(RANKED_CLAIM.replace("FOR UPDATE OF t", "FOR UPDATE"))


def test_advisory_lock_is_held_by_one_session_at_a_time(pg_url):
    with psycopg.connect(pg_url, autocommit=True) as a, psycopg.connect(pg_url, autocommit=True) as b:
        assert a.execute("SELECT pg_try_advisory_lock(42)").fetchone() == (True,)
        assert b.execute("SELECT pg_try_advisory_lock(42)").fetchone() == (False,)
        a.execute("SELECT pg_advisory_unlock(42)")
        assert b.execute("SELECT pg_try_advisory_lock(42)").fetchone() == (True,)


def test_async_pool_runs_concurrent_claims_without_double_claims(pg_url):
    from psycopg_pool import AsyncConnectionPool

    with psycopg.connect(pg_url) as conn:
        conn.execute("CREATE TABLE q (id int PRIMARY KEY, owner int)")
        conn.execute("INSERT INTO q SELECT g, NULL FROM generate_series(1, 40) g")
        conn.commit()

    async def main() -> list[int]:
        async with AsyncConnectionPool(pg_url, min_size=2, max_size=8, open=False) as pool:

            async def claimer(me: int) -> list[int]:
                got = []
                while True:
                    async with pool.connection() as c:
                        row = await (
                            await c.execute(
                                "UPDATE q SET owner = %s WHERE id = (SELECT id FROM q WHERE owner IS NULL"
                                " ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED) RETURNING id",
                                (me,),
                            )
                        ).fetchone()
                    if row is None:
                        return got
                    got.append(row[0])

            per = await asyncio.gather(*(claimer(i) for i in range(8)))
            return [x for ids in per for x in ids]

    claimed = asyncio.run(main())
    assert sorted(claimed) == list(range(1, 41))  # every row once: none lost, none twice


def test_a_missing_server_is_a_reason_naming_what_is_missing(monkeypatch):
    from tests.support import pg

    monkeypatch.setattr(pg, "find_bin_dir", lambda: None)
    why = pg.unavailable()
    assert why is not None
    assert "initdb" in why
    assert "apt-get install postgresql" in why
    with pytest.raises(RuntimeError, match="initdb"):
        pg.start_server()
