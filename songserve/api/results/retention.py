"""Retention: finished jobs and uploads leave with their files after their TTL, and oldest first over the size cap.

With several dispatchers on one store, one sweeps at a time (the store's ``exclusive`` lock: an
advisory lock on PostgreSQL). Active jobs are never touched: only jobs the store marks terminal are candidates. Results folders
that no job in the store owns (a store replaced after damage, a crash between a delete and its
folder's removal) are reported and removed once they are a few minutes old.
"""

from __future__ import annotations

import logging
import time

from songserve.api.results.artifacts import ArtifactStore
from songserve.api.store.protocol import JobStore

log = logging.getLogger(__name__)


class Retention:
    def __init__(self, store: JobStore, artifacts: ArtifactStore, ttl_sec: float, max_mb: float) -> None:
        self.store = store
        self.artifacts = artifacts
        self.ttl_sec = ttl_sec
        self.max_bytes = max_mb * 2**20

    async def sweep(self, now: float | None = None) -> int:
        """Remove expired jobs, then the oldest finished ones while over the cap; returns how many."""
        now = time.time() if now is None else now
        removed = 0
        for job_id in await self.store.expired_jobs(now - self.ttl_sec):
            await self._remove(job_id)
            removed += 1
        for upload_id in await self.store.uploads.expired(now - self.ttl_sec):
            await self._remove_upload(upload_id)
            removed += 1
        total = self.artifacts.total_bytes()
        if total > self.max_bytes:
            for kind, item in await self.store.uploads.finished_oldest_first():
                if kind == "upload":
                    total -= self.artifacts.upload_bytes(item)
                    await self._remove_upload(item)
                else:
                    total -= self.artifacts.job_bytes(item)
                    await self._remove(item)
                removed += 1
                if total <= self.max_bytes:
                    break
        for job_id in self.artifacts.orphans(await self.store.job_ids()):
            log.warning("retention: removing results folder %s, which no job in the store owns", job_id)
            self.artifacts.remove_job(job_id)
            removed += 1
        for upload_id in self.artifacts.upload_orphans(await self.store.uploads.ids()):
            log.warning("retention: removing upload folder %s, which no upload in the store owns", upload_id)
            self.artifacts.remove_upload(upload_id)
            removed += 1
        if removed:
            log.info("retention: removed %d finished jobs or orphaned folders", removed)
        return removed

    async def _remove(self, job_id: str) -> None:
        self.artifacts.remove_job(job_id)
        await self.store.delete_job(job_id)

    async def _remove_upload(self, upload_id: str) -> None:
        """Row first: a reader never finds a ready upload whose codes are gone."""
        await self.store.uploads.delete(upload_id)
        self.artifacts.remove_upload(upload_id)
