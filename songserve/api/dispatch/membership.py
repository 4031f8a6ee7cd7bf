"""Membership: which dispatchers are alive, which workers exist, and which of them this one may use.

One ``step`` every third of ``LEASE_TTL_SEC`` (sooner when a worker announced itself or left: ``soon``),
on the dispatchers' and workers' rows only, then ``reconcile`` (its own loop) on the job tables:
- presence: this dispatcher says it is alive and learns which others are (``heartbeat``);
- the worker registry: it renews the registration of the workers its ``WORKER_URLS`` lists and
  follows the registry (which also holds announced workers) into the pool; the attempts on a worker
  that left stop;
- leases: it renews its worker leases and takes free or expired ones up to its fair share (workers /
  live dispatchers), and hands extras back: an idle one at once, a busy one once its tasks end (it
  gets no new ones meanwhile), so a dispatcher joining a fleet under sustained load gets its share
  too. A lease this dispatcher lost (it stalled past the TTL) ends its attempts there silently: the
  new holder owns them. Each lease has an epoch (``store/members.py``) that every write for a track
  on the worker carries; a lease re-taken after it expired comes back with a new epoch: when nobody
  held it meanwhile (one higher) the attempts there go on under it, else they end like a lost one;
- a pause: a step that finds no renewal for a whole lease behind it (the process stood still: a GC, a
  paused VM, SIGSTOP; the loop's own monotonic clock says so), or a lease lost, reads every active
  track from the store again before the workers are offered to the dispatch pass again. Until a
  step renews a lease, the handle's own bound (``lease_valid_until``: when the renewal was sent +
  TTL) keeps the dispatch pass off that worker, whatever memory says;
- take-over: a worker whose lease it just took may be running tracks of a dispatcher that died (or
  of this one's previous life, at start): they are reattached through the worker's ``/tasks/{id}``.
  Running tracks on a worker gone from the registry, owned here or by a dead dispatcher, are retried.

A worker's lease: free → held by one dispatcher (renewed each step) → [handing back: over its fair
share and busy; no new tasks] → given back (stop, or over its fair share once idle) or expired (its
holder died) → taken by another. Only the holder sends tasks (``WorkerHandle.available`` needs
``leased`` and not ``handing_back``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time

from songserve.api.dispatch.attempts import LEASE_LOST, USER_CANCEL, Attempts
from songserve.api.dispatch.pool import WorkerHandle, WorkerPool
from songserve.api.dispatch.tracks import TrackBook
from songserve.api.settings import DispatcherSettings
from songserve.api.store.members import WorkerRow
from songserve.api.store.protocol import JobStore, StaleTrack

log = logging.getLogger(__name__)


class Membership:
    """Presence, the worker registry and the leases of one dispatcher, kept in the shared store."""

    def __init__(
        self,
        s: DispatcherSettings,
        me: str,
        store: JobStore,
        pool: WorkerPool,
        book: TrackBook,
        attempts: Attempts,
    ) -> None:
        self.me = me
        self.store = store
        self.pool = pool
        self.book = book
        self.attempts = attempts
        self.ttl = s.lease_ttl_sec
        self.static_urls = s.worker_list()
        self.alive: set[str] = {me}  # live dispatchers at the last step
        self._soon = asyncio.Event()
        self._renewed_at: float | None = None  # monotonic: when the last successful renewal was sent
        self._reload = False  # a pause or a lost lease: read the tracks again before dispatching
        self._take_over_due: set[int] = set()  # workers leased here whose running tracks are not reattached yet
        self._live: set[int] = set()  # the registry's workers at the last step
        self._reconcile_due = asyncio.Event()

    def soon(self) -> None:
        """A worker announced itself or left: look at the registry now, not at the next tick."""
        self._soon.set()

    async def wait(self) -> None:
        """Until the next step is due: a third of the lease TTL, or sooner when asked (``soon``)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.ttl / 3):  # not wait_for: it can swallow a cancel on 3.11
                await self._soon.wait()
        self._soon.clear()

    async def step(self, first: bool = False) -> None:
        """Presence, leases and the registry, once (``first``: at start-up, before the health poll runs).

        Touches only the dispatchers' and workers' rows, never the job tables, so a stalled job table
        cannot delay a renewal; what needs the tracks (a reload, take-overs, orphans) is ``reconcile``'s."""
        store, ttl = self.store, self.ttl
        sent = time.monotonic()
        if self._renewed_at is not None and sent - self._renewed_at > ttl:
            self._reload = True
            log.warning(
                "dispatcher %s: no lease renewal for %.1fs (LEASE_TTL_SEC %.1f): paused? Its leases may be "
                "gone; reading its tracks again before it dispatches",
                self.me,
                sent - self._renewed_at,
                ttl,
            )
        self.alive = await store.members.heartbeat(self.me, ttl)
        held = await store.members.renew_leases(self.me, ttl)
        self._renewed_at = sent
        for url in self.static_urls:  # each dispatcher keeps the workers it is configured with registered
            await store.members.register(url, max(3 * ttl, 15.0), announced=False)
        rows = await store.members.live_workers()
        joined, left = self.pool.sync(rows)
        for w in left:
            for key in list(w.assigned.values()):
                self.attempts.stop(key, f"worker {w.worker_id} left the pool")
        if joined and not first:
            await asyncio.gather(*(self.pool.poll(w) for w in joined))
        for w in self.pool.workers:
            if w.leased and w.worker_id not in held:
                # Expired while this dispatcher was slow: still ours unless another took it meanwhile.
                epoch = await store.members.acquire_lease(self.me, w.worker_id, ttl)
                if epoch is None:
                    self._lease_lost(w)
                    continue
                held[w.worker_id] = epoch
            if w.leased and held[w.worker_id] != w.lease_epoch:
                self._new_epoch(w, held[w.worker_id])
        taken = await self._take_leases(held, rows)
        for w in self.pool.workers:
            if w.worker_id in held:
                w.lease_held(held[w.worker_id], self.me)
            else:
                w.lease_gone()
        self._live = {r.worker_id for r in rows}
        # At start, every worker leased here may run tracks of this dispatcher's previous life.
        self._take_over_due |= {w.worker_id for w in (self.pool.workers if first else taken) if w.leased}
        self._grant()
        if first:
            await self.pool.poll_once()
        self._reconcile_due.set()

    def _grant(self) -> None:
        """Offer the workers leased here to the dispatch pass until the last renewal's bound; none
        while the tracks are to be read again (after a pause or a lost lease)."""
        until = (self._renewed_at or 0.0) + self.ttl
        for w in self.pool.workers:
            w.lease_usable_until(0.0 if self._reload else until)

    async def reconcile(self) -> None:
        """The membership's work on the job tables, after a step: read every track again after a pause
        or a lost lease (then the workers are offered again), take over the running tracks of workers
        just leased here, retry those of workers gone from the pool. A store that does not answer
        leaves each of them due for the next time."""
        await self._reconcile_due.wait()
        self._reconcile_due.clear()
        if self._reload:
            for key in await self.book.reload(self.attempts.running):
                self.attempts.stop(key, USER_CANCEL)
            self._reload = False
            self._grant()
        await self._take_over()
        await self._orphans(self._live)

    def _new_epoch(self, w: WorkerHandle, epoch: int) -> None:
        """``w``'s lease came back to this dispatcher with a new epoch (re-taken after it expired)."""
        if epoch == w.lease_epoch + 1:  # nobody held it meanwhile: the attempts there go on under it
            log.warning(
                "worker %d: lease re-taken after it expired (epoch %d -> %d; nobody held it meanwhile)",
                w.worker_id,
                w.lease_epoch,
                epoch,
            )
            self.attempts.refence(w, w.lease_epoch, epoch)
            return
        log.warning(
            "worker %d: lease re-taken at epoch %d, held elsewhere since epoch %d: its tracks are read "
            "again from the store and the worker",
            w.worker_id,
            epoch,
            w.lease_epoch,
        )
        self._lease_lost(w)
        w.lease_held(epoch, self.me)  # ours again, under the new epoch
        self._take_over_due.add(w.worker_id)

    async def leave(self) -> None:
        """The leases go now, so another dispatcher takes the workers (and their tracks) at once."""
        try:
            await self.store.members.leave(self.me)
        except Exception as exc:  # the store is gone: the leases expire on their own
            log.warning("dispatcher %s: could not release its leases (%s)", self.me, exc)

    async def _take_leases(self, held: dict[int, int], rows: list[WorkerRow]) -> list[WorkerHandle]:
        """Take free or expired leases up to this dispatcher's fair share; hand extras back (an idle
        one now, a busy one once its tasks end: it is marked ``handing_back`` and gets no new ones)."""
        share = math.ceil(len(rows) / max(1, len(self.alive)))
        taken = []
        for r in rows:
            if len(held) >= share:
                break
            if r.worker_id in held or r.lease_owner not in (None, self.me):
                continue
            if (epoch := await self.store.members.acquire_lease(self.me, r.worker_id, self.ttl)) is not None:
                held[r.worker_id] = epoch
                if (w := self.pool.by_id(r.worker_id)) is not None:
                    taken.append(w)
                    log.info("worker %d (%s): leased by %s", w.worker_id, w.url, self.me)
        extra = len(held) - share if len(self.alive) > 1 else 0
        mine = [w for w in self.pool.workers if w.worker_id in held]
        for w in sorted(mine, key=lambda w: (bool(w.assigned), w.worker_id)):  # idle ones go first
            if extra <= 0:
                w.hand_back(False)
                continue
            extra -= 1
            if w.assigned or self.attempts.fenced_on(w.worker_id):  # its last answers are still being applied
                if not w.handing_back:
                    log.info(
                        "worker %d: lease goes back once its tasks end (fair share %d of %d dispatchers)",
                        w.worker_id,
                        share,
                        len(self.alive),
                    )
                w.hand_back(True)
                continue
            await self.store.members.release_lease(self.me, w.worker_id)
            held.pop(w.worker_id, None)
            w.hand_back(False)
            log.info(
                "worker %d: lease given back (fair share %d of %d dispatchers)", w.worker_id, share, len(self.alive)
            )
        return taken

    def _lease_lost(self, w: WorkerHandle) -> None:
        log.warning(
            "worker %d: lease (epoch %d) lost: this dispatcher stalled past LEASE_TTL_SEC? It stops "
            "acting for the %d tracks it ran there",
            w.worker_id,
            w.lease_epoch,
            len(w.assigned),
        )
        w.lease_gone()
        self._reload = True
        for key in list(w.assigned.values()):
            self.attempts.stop(key, LEASE_LOST)

    async def _take_over(self) -> None:
        """Reattach the tracks running on workers just leased here (their dispatcher died, restarted or
        was paused past its lease), as the store has them; a worker whose take-over the store cut
        short is taken over at the next step."""
        for worker_id in sorted(self._take_over_due):
            w = self.pool.by_id(worker_id)
            fence = self.attempts.fence_of(w) if w is not None else None
            if w is None or fence is None:
                self._take_over_due.discard(worker_id)
                continue
            for key in await self.store.running_on(w.worker_id):
                if key in self.attempts.running:
                    continue
                stored = await self.store.load_job(key[0])
                for cancelled in self.book.merge(key[0], stored, self.attempts.running):
                    self.attempts.stop(cancelled, USER_CANCEL)
                job = self.book.jobs.get(key[0])
                t = job.tracks[key[1]] if job is not None else None
                if job is None or t is None or not t.status.running or t.worker_id != w.worker_id:
                    continue
                try:
                    await self.book.change(t, t.status, fence=fence, owner=self.me)
                except StaleTrack:
                    continue
                if self.attempts.reattach(job, t):
                    log.info("track %s/%d: taking over task %s on worker %d", *key, t.task_id, w.worker_id)
            self._take_over_due.discard(worker_id)

    async def _orphans(self, live: set[int]) -> None:
        """Running tracks on a worker gone from the registry, owned here or by a dead dispatcher: retry."""
        for job in list(self.book.jobs.values()):
            for t in job.tracks:
                if not t.status.running or t.key in self.attempts.running or t.worker_id in live:
                    continue
                if t.owner == self.me or t.owner not in self.alive:
                    self.attempts.abandon(job, t, "its worker is no longer in the pool")
