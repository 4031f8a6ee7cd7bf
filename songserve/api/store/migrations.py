"""The store's one migration runner, and what it shares: a step, the refusal of a newer schema, the log line.

Why one runner: both engines walk the same numbered versions, forward only, exactly once even when
several dispatchers start together. Each step runs in one transaction with its version bump, under
the schema lock (SQLite's write lock, which every transaction takes; a PostgreSQL advisory lock), so a
crash mid-step leaves the store at the previous version and a second process waits, then finds the
new version and skips. Only the steps' SQL is per dialect (``store/sqlite/migrations.py``,
``store/postgres/migrations.py``), and where each engine keeps its version (SQLite's ``PRAGMA
user_version``, PostgreSQL's ``songserve_schema`` table), which existing stores already carry.

To change the schema: append a step with the next number to both engines; never edit a step that has
shipped. A store above the last known version was written by a newer build and is refused.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from songserve.api.store.connector import Transactional, Tx

log = logging.getLogger(__name__)
SCHEMA_LOCK = 0x50_4E_47_53  # the advisory-lock key of schema changes ("SGNP"), the same in every build

# Where each engine keeps its schema version.
PREPARE = {"sqlite": "", "postgresql": "CREATE TABLE IF NOT EXISTS songserve_schema (version INTEGER NOT NULL)"}
READ = {
    "sqlite": "PRAGMA user_version",
    "postgresql": "SELECT COALESCE(MAX(version), 0) AS user_version FROM songserve_schema",
}
WRITE = {"sqlite": "PRAGMA user_version = {version}", "postgresql": "INSERT INTO songserve_schema VALUES ({version})"}


@dataclass(frozen=True)
class Migration:
    """One schema step: its number, what it is for (logged), and its statements, run in order."""

    version: int
    what: str
    statements: tuple[str, ...] = ()


class NewerSchemaError(Exception):
    """The store was written by a newer build; opening it here could lose what that build stored."""

    def __init__(self, found: int, known: int) -> None:
        super().__init__(f"schema version {found}, newer than this build's {known}")
        self.found, self.known = found, known

    def refusal(self, where: str, instead: str) -> str:
        """The one line that refuses the store at ``where``; ``instead``: the setting that points elsewhere."""
        return (
            f"The job store {where} has schema version {self.found}, newer than this build's {self.known}: "
            f"run the newer songserve on it, or point {instead}."
        )


async def _locked_version(conn: Transactional, tx: Tx) -> int:
    """The store's schema version, read under the schema lock (held until ``tx`` ends)."""
    await tx.lock(SCHEMA_LOCK)
    if prepare := conn.dialect.pick(PREPARE):
        await tx.execute(prepare)
    row = await tx.fetch_one(conn.dialect.pick(READ))
    return int(row["user_version"]) if row else 0


async def migrate(conn: Transactional, migrations: tuple[Migration, ...]) -> list[int]:
    """Bring the store behind ``conn`` to the last of ``migrations``; returns the versions applied.

    Raises ``NewerSchemaError`` for a store above the last known version."""
    known = migrations[-1].version
    async with conn.transaction() as tx:
        first = await _locked_version(conn, tx)  # the usual start: one short transaction, nothing to do
    if first > known:
        raise NewerSchemaError(first, known)
    applied: list[int] = []
    for step in migrations:
        if step.version <= first:
            continue
        async with conn.transaction() as tx:
            current = await _locked_version(conn, tx)  # another process may have got here first
            if current > known:
                raise NewerSchemaError(current, known)
            if current < step.version:
                for sql in step.statements:
                    await tx.execute(sql)
                await tx.execute(conn.dialect.pick(WRITE).format(version=int(step.version)))
                applied.append(step.version)
    log_migrated(first, applied, [step.what for step in migrations if step.version in applied])
    return applied


def log_migrated(first: int, applied: list[int], what: list[str]) -> None:
    """One line, whatever the number of steps: a fresh store is made, not "migrated" seven times."""
    if not applied:
        return
    if first == 0:
        log.info("job store: created (schema version %d)", applied[-1])
    else:
        log.info("job store: schema migrated from version %d to %d (%s)", first, applied[-1], "; ".join(what))
