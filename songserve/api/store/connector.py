"""The narrow connector each engine gives the store: statements in, rows out, and a transaction.

Why narrow: the store's repositories (jobs and tracks in ``store/jobs.py``; ``members.py``,
``outbox.py``, ``uploads.py``, ``quota.py``) are written once, over this interface, and each engine
(``store/sqlite/connector.py``, ``store/postgres/connector.py``) only says how a statement reaches its
database. What the engines do differently lives in two places only:
- ``Dialect``: the SQL spellings that differ (placeholders, the store's clock, ``GREATEST``, row locks),
  filled into a statement's ``{now}``-style fields by ``render``, so a query is written once where the
  dialects agree and per dialect (``Dialect.pick``) only where they do not;
- the connector: what only one engine has (PostgreSQL's ``NOTIFY``, advisory locks, ``LISTEN``,
  session locks for ``exclusive``; SQLite's own thread), behind calls that are no-ops elsewhere.

Statements are written with ``?`` placeholders; rows come back as dicts by column name. A unique
constraint refused by either engine is ``Conflict``; any other database failure is ``StoreError``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Protocol

Row = dict[str, Any]
Params = Sequence[Any]


class Conflict(Exception):
    """A write broke a unique constraint (an idempotency key, an event id, an upload id already stored)."""


@dataclass(frozen=True)
class Dialect:
    """How one engine spells what the dialects do not share; ``render`` fills a statement's fields.

    Fields a statement may use: ``{now}`` (the store's clock, epoch seconds), ``{greatest}`` (the larger
    of two values), ``{skip_locked}`` (lock the selected rows, skipping those another holds),
    ``{for_share}`` (lock the row against a change until the transaction ends)."""

    name: str
    now: str
    greatest: str
    skip_locked: str
    for_share: str
    placeholder: str  # what ``?`` becomes
    fields: Mapping[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        own = {"now": self.now, "greatest": self.greatest, "skip_locked": self.skip_locked}
        object.__setattr__(self, "fields", {**own, "for_share": self.for_share})

    def render(self, sql: str) -> str:
        """``sql`` in this dialect: its fields filled, its ``?`` placeholders this engine's (cached)."""
        return _render(self, sql)

    def pick(self, variants: Mapping[str, str]) -> str:
        """The variant of a statement written for this dialect (where the dialects differ)."""
        return variants[self.name]


@lru_cache(maxsize=1024)
def _render(dialect: Dialect, sql: str) -> str:
    for name, value in dialect.fields.items():
        sql = sql.replace("{" + name + "}", value)
    if dialect.placeholder != "?":
        sql = sql.replace("%", "%%").replace("?", dialect.placeholder)
    return sql


def marks(n: int) -> str:
    """``?, ?, …`` for ``n`` values (an ``IN`` list or a row); at least one."""
    return ", ".join("?" for _ in range(max(1, n)))


class Reader(Protocol):
    """Reads: by themselves on the connector, or inside a transaction."""

    async def fetch_one(self, sql: str, params: Params = ()) -> Row | None: ...
    async def fetch_all(self, sql: str, params: Params = ()) -> list[Row]: ...


class Tx(Reader, Protocol):
    """One open transaction: every statement commits with the others or none does."""

    async def execute(self, sql: str, params: Params = ()) -> int:
        """Run one statement; the number of rows it changed."""

    async def execute_many(self, sql: str, rows: Sequence[Params]) -> None:
        """Run one statement once per parameter row."""

    async def notify(self, job_id: str) -> None:
        """Tell the other dispatchers that ``job_id`` changed, on commit (none on SQLite: one dispatcher)."""

    async def lock(self, key: int, name: str | None = None) -> None:
        """Wait for the lock ``(key, name)`` until the transaction ends (PostgreSQL's advisory lock;
        SQLite's write lock is already held by every transaction)."""


class Transactional(Protocol):
    """What the migration runner needs: the dialect, and transactions."""

    @property
    def dialect(self) -> Dialect: ...

    def transaction(self) -> AbstractAsyncContextManager[Tx]:
        """A write transaction; a statement that fails rolls it back."""


class Connector(Reader, Transactional, Protocol):
    """One engine's way to its database; ``Store`` and its repositories hold one."""

    async def read_together(self, statements: Sequence[tuple[str, Params]]) -> list[list[Row]]:
        """Several reads seen at one moment (a job and its tracks)."""

    async def execute(self, sql: str, params: Params = ()) -> int:
        """One write statement on its own; the rows it changed."""

    def listen(self, on_change: Callable[[str], None]) -> AbstractAsyncContextManager[None]:
        """While entered, ``on_change(job_id)`` for the changes other dispatchers announce."""

    def exclusive(self, name: str) -> AbstractAsyncContextManager[bool]:
        """True to the one holder of ``name`` now, False to the others."""

    async def probe(self, timeout: float) -> None:
        """Could a write to the job tables start within ``timeout``? ``StoreError`` saying why not."""

    async def close(self) -> None: ...
