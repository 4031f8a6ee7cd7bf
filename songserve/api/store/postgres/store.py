"""The PostgreSQL engine of the job store: several dispatchers, one queue (``STORE_URL=postgresql://…``).

``PgStore`` is the store written once (``store/jobs.py``) over the PostgreSQL connector
(``connector.py``: two pools, ``NOTIFY``/``LISTEN``, advisory locks, ``SKIP LOCKED`` claims; the pools
and their time limits: ``conn.py``). Opening it connects once, plainly, and migrates (the steps:
``migrations.py``; the runner: ``store/migrations.py``), then opens the pools.

- Claims lock the queued rows they want with ``FOR UPDATE SKIP LOCKED``, so two dispatchers never
  claim one track and neither waits on the other.
- Fenced writes check the lease row with ``FOR SHARE`` in their own transaction, so a lease change
  waits for the write that checked it, and the write re-reads a change just committed.
- Two pools: one for the routes and one for the background loops and attempts (``BACKGROUND``
  picks), so routes stalled on a locked table cannot take every connection the loops need.
- Leases and presence are timed on the database's clock, so hosts' clocks need not agree.
"""

from __future__ import annotations

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import PoolTimeout

from songserve.api.store.jobs import Store
from songserve.api.store.migrations import NewerSchemaError, migrate
from songserve.api.store.postgres.conn import StoreLimits, redact
from songserve.api.store.postgres.connector import PgConnector, PgSession
from songserve.api.store.postgres.migrations import MIGRATIONS
from songserve.errors import ConfigError

# Schema steps may rewrite a table and wait for another dispatcher's migration: limits of their own.
MIGRATION_LIMITS = StoreLimits(statement_timeout_sec=600.0, lock_timeout_sec=120.0)


class PgStore(Store):
    """The PostgreSQL engine of ``JobStore``: the store over ``PgConnector``; open it with ``open``."""

    def __init__(self, url: str, origin: str, pool_size: int = 10, limits: StoreLimits | None = None) -> None:
        self.url = url
        self.origin = origin
        self.limits = limits or StoreLimits()
        self.db: PgConnector = PgConnector(url, origin, pool_size, self.limits)
        super().__init__(self.db, redact(url), shared=True)

    @classmethod
    async def open(
        cls, url: str, origin: str, pool_size: int = 10, timeout: float = 10.0, limits: StoreLimits | None = None
    ) -> PgStore:
        """Connect and migrate; a store that cannot be used raises ``ConfigError`` in one line."""
        store = cls(url, origin, pool_size, limits)
        try:
            # One plain connection first: a wrong URL fails once, in one line, not in the pool's retries.
            async with await psycopg.AsyncConnection.connect(
                url,
                autocommit=True,
                row_factory=dict_row,
                connect_timeout=max(1, int(timeout)),
                options=MIGRATION_LIMITS.options(url),
            ) as conn:
                await migrate(PgSession(conn, origin), MIGRATIONS)
            await store.db.open(timeout)
            await store.read_ident()
        except NewerSchemaError as exc:
            await store.close()
            raise ConfigError(exc.refusal(store.where, "STORE_URL at another database")) from None
        except (psycopg.Error, PoolTimeout) as exc:
            await store.close()
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"The job store {store.where} cannot be opened ({first}).") from None
        return store
