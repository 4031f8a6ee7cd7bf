"""The lease each attempt writes under: fences, and what the worker is told of them.

The part of ``Attempts`` (``attempts.py`` mixes it in) that ties an attempt to the lease it was
claimed under. An attempt holds the ``Fence`` (this dispatcher, the worker, the lease's epoch) and
every write it makes for its tracks carries it; the store refuses one made under a lease that has
expired or passed on (``LeaseLost``), and the attempt then ends at once without touching the track:
the lease's holder reconciles it with the worker. The worker is told the lease too (the
``Songserve-Lease`` header, ``worker/fence.py``), so it refuses a task sent under an older one.
The membership asks here whether a lease may be given back (``fenced_on``) and moves the attempts
onto a lease it re-took unchanged (``refence``).
"""

from __future__ import annotations

import dataclasses

from songserve.api.dispatch.pool import WorkerHandle
from songserve.api.jobs.records import Key
from songserve.api.store.members import Fence
from songserve.api.store.protocol import JobStore


class AttemptFences:
    """Which lease each running attempt writes under; the state is ``Attempts``'."""

    me: str
    store: JobStore
    _fences: dict[Key, Fence]  # the lease each running attempt's writes are made under

    def fence_of(self, w: WorkerHandle) -> Fence | None:
        """The lease this dispatcher holds on ``w`` now (None: none)."""
        return Fence(self.me, w.worker_id, w.lease_epoch) if w.leased and w.lease_epoch else None

    def lease_header(self, fence: Fence | None) -> str | None:
        """What the worker is told of the lease a call is made under (``worker/fence.py``)."""
        return f"{self.store.ident} {fence.epoch}" if fence is not None and self.store.ident else None

    def fenced_on(self, worker_id: int) -> bool:
        """Whether an attempt of this dispatcher still writes under its lease on ``worker_id`` (the
        worker may be free while its answer is applied): that lease is not given back yet."""
        return any(f.worker_id == worker_id for f in self._fences.values())

    def refence(self, w: WorkerHandle, old: int, new: int) -> None:
        """This dispatcher re-took ``w``'s lease and nobody held it between (epoch ``old`` + 1 = ``new``):
        the attempts there go on under the new epoch."""
        for key, f in list(self._fences.items()):
            if f.worker_id == w.worker_id and f.epoch == old:
                self._fences[key] = dataclasses.replace(f, epoch=new)
