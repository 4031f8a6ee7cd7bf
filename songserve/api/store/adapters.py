"""An uploaded adapter as the job store keeps it, so that any dispatcher of a shared store answers for it.

One row per upload (table ``adapters``, schema version 8 of both engines): its name (one namespace
with the workers' own ``ADAPTERS_DIR`` folders), the name of the API key that uploaded it (``caller``:
only keys that may see it find it), its weights' size and SHA-256 (what a worker's ``/health`` is
compared with, to send a missing or stale copy), its rank and targets. The files themselves are in
the results folder (``adapters/<name>/``) and on every worker. ``insert`` takes a name once: the
second upload of a name finds it taken, whichever dispatcher it came to.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol

from songserve.api.store.connector import Connector
from songserve.api.store.queries import adapters as q
from songserve.api.store.queries.adapters import ADAPTER_COLUMNS


@dataclass
class AdapterRecord:
    name: str
    caller: str | None  # the name of the API key that uploaded it (None: the dispatcher has no keys)
    bytes: int  # both files
    sha256: str  # of adapter_model.safetensors
    rank: int
    targets: list[str] = field(default_factory=list)
    created_at: float = 0.0

    def values(self) -> list[object]:
        """The row's values in ``ADAPTER_COLUMNS`` order, as both engines store them."""
        return [json.dumps(self.targets) if c == "targets" else getattr(self, c) for c in ADAPTER_COLUMNS]


def adapter_from_row(row: Any) -> AdapterRecord:
    kw = {name: row[name] for name in ADAPTER_COLUMNS}
    kw["targets"] = json.loads(kw["targets"]) if isinstance(kw["targets"], str) else list(kw["targets"])
    return AdapterRecord(**kw)


class AdapterRows(Protocol):
    """``JobStore.adapters``: the uploaded adapters' rows (every method one short statement)."""

    async def insert(self, a: AdapterRecord) -> bool:
        """Store ``a``; False (nothing written) when its name is taken."""

    async def load(self, name: str) -> AdapterRecord | None: ...
    async def all(self) -> list[AdapterRecord]: ...
    async def count_by(self, caller: str | None) -> int:
        """How many adapters the key named ``caller`` has uploaded."""

    async def delete(self, name: str) -> bool: ...


class Adapters:
    """``AdapterRows`` over the store's connector."""

    def __init__(self, conn: Connector) -> None:
        self.conn = conn

    async def insert(self, a: AdapterRecord) -> bool:
        return await self.conn.execute(q.INSERT, a.values()) == 1

    async def load(self, name: str) -> AdapterRecord | None:
        row = await self.conn.fetch_one(q.LOAD, (name,))
        return adapter_from_row(row) if row else None

    async def all(self) -> list[AdapterRecord]:
        return [adapter_from_row(r) for r in await self.conn.fetch_all(q.ALL)]

    async def count_by(self, caller: str | None) -> int:
        row = await self.conn.fetch_one(q.COUNT_BY, (caller,))
        return int(row["n"]) if row else 0

    async def delete(self, name: str) -> bool:
        return await self.conn.execute(q.DELETE, (name,)) == 1
