"""The worker's own fence: a task from a dispatcher whose lease on this worker has passed on is refused.

Why the worker checks too: the store refuses every write made under a lease that is gone, but a
dispatcher can claim a track under a valid lease and then stall before its ``POST /generate`` leaves
(a GC, a paused VM). Meanwhile the lease passes on, its new holder asks this worker about the claimed
task (``GET /tasks/{id}``: unknown) and queues it again; the stalled request arriving afterwards
would run a generation nobody can apply, and keep this worker from the new holder's tasks.

So every dispatcher call that acts under a lease sends ``Songserve-Lease: <store id> <epoch>`` (the
store's own id: dispatchers of different stores number their epochs apart). The worker remembers the
highest epoch it has seen per store, from ``/generate``, ``/generate_batch`` and ``/tasks``, and
answers a task sent under a lower one 409 (nothing runs; the sender's fenced write then fails in the
store and it stops acting for the track). A call without the header (the reference dispatcher, a
person with curl) is not fenced.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict

from songserve.errors import SongserveError

log = logging.getLogger(__name__)
HEADER = "Songserve-Lease"
VALUE = re.compile(r"^([0-9A-Za-z_-]{1,64}) ([0-9]{1,18})$")
STORES_KEPT = 64  # stores remembered (a worker serves a handful of fleets at most)


class StaleLease(SongserveError):
    """A task sent under a lease epoch lower than one this worker has seen for the same store."""

    http_status = 409


class LeaseFences:
    """The highest lease epoch seen per store."""

    def __init__(self) -> None:
        self._highest: OrderedDict[str, int] = OrderedDict()

    def note(self, header: str | None) -> tuple[str, int] | None:
        """Remember the header's epoch if it is the highest of its store; returns (store, epoch), or None
        for no header or one that is not ``<store id> <epoch>`` (not fenced: nothing to compare)."""
        m = VALUE.match(header or "")
        if m is None:
            return None
        store, epoch = m.group(1), int(m.group(2))
        if epoch > self._highest.get(store, -1):
            self._highest[store] = epoch
        self._highest.move_to_end(store)
        while len(self._highest) > STORES_KEPT:
            self._highest.popitem(last=False)
        return store, epoch

    def check(self, header: str | None, task_ids: list[str]) -> None:
        """Refuse (``StaleLease``) a task sent under an epoch below the highest seen for its store."""
        seen = self.note(header)
        if seen is None:
            return
        store, epoch = seen
        highest = self._highest[store]
        if epoch < highest:
            log.warning(
                "tasks %s: refused, sent under lease epoch %d of store %s, which has reached %d",
                ", ".join(task_ids),
                epoch,
                store,
                highest,
            )
            raise StaleLease(
                f"This worker is leased under epoch {highest} now; the task was sent under epoch {epoch} by a "
                "dispatcher whose lease has passed on. Nothing was run."
            )
