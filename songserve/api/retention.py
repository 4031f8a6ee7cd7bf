"""Retention: finished jobs and their files leave after their TTL, and oldest first over the size cap.

Active jobs are never touched: only jobs the store marks terminal are candidates.
"""

from __future__ import annotations

import logging
import time

from songserve.api.artifacts import ArtifactStore
from songserve.api.store import JobStore

log = logging.getLogger(__name__)


class Retention:
    def __init__(self, store: JobStore, artifacts: ArtifactStore, ttl_sec: float, max_mb: float) -> None:
        self.store = store
        self.artifacts = artifacts
        self.ttl_sec = ttl_sec
        self.max_bytes = max_mb * 2**20

    def sweep(self, now: float | None = None) -> int:
        """Remove expired jobs, then the oldest finished ones while over the cap; returns how many."""
        now = time.time() if now is None else now
        removed = 0
        for job_id in self.store.expired_jobs(now - self.ttl_sec):
            self._remove(job_id)
            removed += 1
        total = self.artifacts.total_bytes()
        if total > self.max_bytes:
            for job_id in self.store.finished_jobs_oldest_first():
                total -= self.artifacts.job_bytes(job_id)
                self._remove(job_id)
                removed += 1
                if total <= self.max_bytes:
                    break
        if removed:
            log.info("retention: removed %d finished jobs", removed)
        return removed

    def _remove(self, job_id: str) -> None:
        self.artifacts.remove_job(job_id)
        self.store.delete_job(job_id)
