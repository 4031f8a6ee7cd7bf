"""Workers that join and leave (``POST /workers``, ``DELETE /workers/{id}``): the worker token, the registry.

A part of the job service of its own: it needs the settings' worker token, the store's registry and
the dispatcher's membership, nothing of the jobs. Every dispatcher on the store sees a registration.
"""

from __future__ import annotations

import hmac
import logging

from songserve.api.dispatch.dispatcher import Dispatcher
from songserve.api.service.refusals import AnnounceRefused
from songserve.api.settings import DispatcherSettings
from songserve.api.store.protocol import JobStore
from songserve.errors import NotFoundError
from songserve.schemas import WorkerAnnounced, WorkerAnnouncement

log = logging.getLogger(__name__)


class Announcements:
    def __init__(self, s: DispatcherSettings, store: JobStore, dispatcher: Dispatcher) -> None:
        self.s, self.store, self.dispatcher = s, store, dispatcher

    def _check_worker_token(self, authorization: str | None) -> None:
        token = self.s.worker_token
        if not token:
            raise AnnounceRefused("Announcing is off here: start the dispatcher with a WORKER_TOKEN.", 403)
        given = (authorization or "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), token.encode()):
            raise AnnounceRefused("Authorization: a worker announces itself with Bearer <WORKER_TOKEN>.", 401)

    async def announce(self, body: WorkerAnnouncement, authorization: str | None) -> WorkerAnnounced:
        """A worker joins (or renews its registration) for ``ttl_sec``; every dispatcher on the store sees it."""
        self._check_worker_token(authorization)
        worker_id = await self.store.members.register(body.url.rstrip("/"), body.ttl_sec, announced=True)
        if not self.dispatcher.knows_worker(worker_id):
            log.info("worker %d (%s) announced itself for %.0fs", worker_id, body.url, body.ttl_sec)
            self.dispatcher.membership_soon()
        return WorkerAnnounced(worker_id=worker_id, expires_in_sec=body.ttl_sec)

    async def withdraw(self, worker_id: int, authorization: str | None) -> dict[str, object]:
        """A worker leaves: no new tracks; a track it still runs is retried elsewhere."""
        self._check_worker_token(authorization)
        if not await self.store.members.withdraw(worker_id):
            raise NotFoundError(f"Worker {worker_id} is not registered.")
        log.info("worker %d left", worker_id)
        self.dispatcher.membership_soon()
        return {"worker_id": worker_id, "left": True}
