"""Queue order: higher priority first, fair across jobs, FIFO within a priority.

Fairness is round-robin over jobs: among tracks of equal priority, the next one comes from the job
with the fewest tracks already started, so a 4-track job does not hold every worker for its whole
length while a later 1-track job waits. Ties go to the older job, then the lower track index.
Pure functions: the service feeds them its queued tracks and the per-job started counts.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class QueueEntry:
    job_id: str
    index: int
    priority: int
    job_seq: int  # submission order


def order(entries: Iterable[QueueEntry], started: Mapping[str, int]) -> list[QueueEntry]:
    """The queue in dispatch order, given how many tracks of each job have started.

    Simulates dispatching one at a time (each pick raises its job's count): O(n log n) with a heap
    of jobs keyed by (priority, started count, submission order).
    """
    by_job: dict[str, list[QueueEntry]] = {}
    for e in entries:
        by_job.setdefault(e.job_id, []).append(e)
    heap = []
    for job_id, items in by_job.items():
        items.sort(key=lambda e: e.index, reverse=True)  # pop() takes the lowest index
        head = items[-1]
        heap.append((-head.priority, started.get(job_id, 0), head.job_seq, job_id))
    heapq.heapify(heap)
    out: list[QueueEntry] = []
    while heap:
        neg_prio, count, seq, job_id = heapq.heappop(heap)
        items = by_job[job_id]
        out.append(items.pop())
        if items:
            heapq.heappush(heap, (neg_prio, count + 1, seq, job_id))
    return out
