"""The worker's own status (``WorkerStatus``, as ``/health`` reports it) and its legal moves, in one table.

    initializing ──models loaded──▶ idle ──a batch or an encoding claimed──▶ busy
         │                            ▲                                        │
         │                            └──────────────it ends───────────────────┘
         └──loading failed──▶ error   (for good: the process is restarted, not the status)

``stalled`` is never held: ``/health`` reports it while a running task has been silent past
``STALL_TIMEOUT_SEC`` (``WorkerRuntime.health``), so no move leads there. The runtime changes its
status only through ``check_transition``; a move outside the table is a bug, raised at once.
"""

from __future__ import annotations

from songserve.schemas import WorkerStatus

_ALLOWED: dict[WorkerStatus, frozenset[WorkerStatus]] = {
    WorkerStatus.initializing: frozenset({WorkerStatus.idle, WorkerStatus.error}),
    WorkerStatus.idle: frozenset({WorkerStatus.busy}),
    WorkerStatus.busy: frozenset({WorkerStatus.idle}),
    WorkerStatus.error: frozenset(),
    WorkerStatus.stalled: frozenset(),  # derived in /health, never held
}


class IllegalTransition(RuntimeError):
    pass


def check_transition(old: WorkerStatus, new: WorkerStatus) -> None:
    """Raise ``IllegalTransition`` unless the worker may go from ``old`` to ``new`` (staying is no move)."""
    if new != old and new not in _ALLOWED[old]:
        raise IllegalTransition(f"worker cannot go from {old} to {new}")
