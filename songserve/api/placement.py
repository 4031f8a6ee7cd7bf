"""Which of the free workers a queued track goes to.

Most tracks take the first free worker (in the pool's order), avoiding the one a track just
failed on for an environment reason. A retake is pickier: only our workers can continue a song
(a reference worker knows nothing of a prefix), and among them one whose ``/health`` lists a KV
snapshot of the same original (``kv_snapshots.slots[].origin``) is preferred, since it prefills
only what the snapshot does not hold. A busy holder is not waited for: any free worker gives the
same song, only the prefill is longer.
"""

from __future__ import annotations

from songserve.api.pool import WorkerHandle
from songserve.api.retakes import origin_of
from songserve.api.store import Job, Track


def holds_snapshot(w: WorkerHandle, origin: str) -> bool:
    """The worker's latest health lists a KV snapshot of ``origin``."""
    slots = (w.health.kv_snapshots or {}).get("slots") or []
    return any(isinstance(s, dict) and s.get("origin") == origin for s in slots)


def pick(free: list[WorkerHandle], job: Job, t: Track) -> WorkerHandle | None:
    """The worker for ``t`` among ``free`` (non-empty), or None when none of them can run it."""
    candidates = free
    cf = job.request.continue_from
    if cf is not None:
        candidates = [w for w in free if not w.client.reference]
        holders = [w for w in candidates if holds_snapshot(w, origin_of(cf))]
        candidates = holders or candidates
        if not candidates:
            return None
    return next((w for w in candidates if w.worker_id != t.avoid_worker), candidates[0])
