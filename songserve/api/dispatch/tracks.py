"""The track book: the active jobs, the queue, and every change of a track's state.

A track's lifetime (the legal moves are in ``jobs/states.py``; who makes them is said on the right):

    queued ──claim──▶ generating → superres → decoding ──files copied──▶ done      (attempts.py)
      ▲                     │ the model failed with a clear sentence ──▶ error     (attempts.py)
      └──── retry ◀─────────┤ worker lost / unreachable / lost the task / stalled / past deadline
                            │ / failed for an environment reason (while tries remain, else error:
                            │ attempts.py, with the rules of retries.py)
                            └ the user cancelled ──────────────────▶ cancelled

Store first: a state change is written before it shows in memory (``change`` writes the new state,
then applies it), so memory never claims what the store does not hold. Writes are compare-and-set
on the (status, owner) this dispatcher last saw, and those for a track on a worker carry the lease
they are made under (a ``Fence``, checked by the store): when another dispatcher changed the track
first, or the lease is gone (``StaleTrack``, ``LeaseLost``), nothing is applied and the job is read
again from the store. The book decides none of the moves: the attempts (``attempts.py``: claim,
progress, done, error, retry), the user's cancel, the dispatcher's
repairs and the membership's take-overs ask for them here.

With a shared store (PostgreSQL) the active jobs in memory are this dispatcher's view of the shared
queue: its own running tracks are the truth, the rest follow the store (``merge``, on every event).
Which tracks are "its own running" ones is the caller's to say (``live``: the tracks its attempts
run), since the attempts hold them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Container

from songserve.api.dispatch import queue_order
from songserve.api.jobs.facts import Waiting
from songserve.api.jobs.records import Job, Key, Track
from songserve.api.jobs.states import TrackStatus, check_transition, job_status
from songserve.api.metrics import DispatcherMetrics
from songserve.api.store.members import Fence
from songserve.api.store.outbox import PROGRESS_EVENT_SEC
from songserve.api.store.protocol import STORED_TRACK_FIELDS, JobStore, StaleTrack
from songserve.api.webhooks.events import JobEvents

log = logging.getLogger(__name__)


class ChangeFeed:
    """A version number bumped on every visible change; SSE streams wait on it."""

    def __init__(self) -> None:
        self.version = 0
        self._event = asyncio.Event()

    def touch(self) -> None:
        self.version += 1
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, since: int, timeout: float) -> int:
        if self.version == since:
            try:  # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancel
                async with asyncio.timeout(timeout):
                    await self._event.wait()
            except TimeoutError:
                pass
        return self.version


class TrackBook:
    """The active jobs, the queue, and every transition of their tracks."""

    def __init__(self, store: JobStore, me: str, metrics: DispatcherMetrics, events: JobEvents | None = None) -> None:
        self.store = store
        self.events = events or JobEvents()  # the webhook events each change makes, written with it
        self.me = me  # this dispatcher's id: the owner written on the tracks it runs
        self.metrics = metrics
        self.changes = ChangeFeed()
        self.jobs: dict[str, Job] = {}  # active jobs only
        self.queue: dict[Key, queue_order.QueueEntry] = {}
        self.positions: dict[Key, int] = {}  # 1-based queue positions
        self.waiting = Waiting()  # why the queued tracks have not started (the last dispatch pass's finding)
        # The queue's order, made again only after something it depends on changed (``_stale``): with a
        # thousand tracks queued, ordering them on every submit and dispatch pass held the event loop.
        self._order: list[queue_order.QueueEntry] = []
        self._stale = False
        self._placed: list[queue_order.QueueEntry] | None = None  # the order ``positions`` were made from
        self._write = asyncio.Lock()  # one track write at a time: each sees the state the last one left
        self._dirty: set[str] = set()  # jobs to read again from the store ("*": all)
        self._dirty_event = asyncio.Event()

    # ---- the queue ------------------------------------------------------------------------------
    def add(self, job: Job) -> None:
        """An active job joins the book (a new one, or one restored from the store); its queued tracks
        join the queue. Callers refresh the order once."""
        self.jobs[job.job_id] = job
        self.order_changed()
        for t in job.tracks:
            if t.status is TrackStatus.queued:
                self.enqueue(job, t)

    def enqueue(self, job: Job, t: Track) -> None:
        """Queue a track; callers refresh the order once (``reorder`` or a dispatch pass)."""
        self.queue[(job.job_id, t.index)] = queue_order.QueueEntry(job.job_id, t.index, job.priority, job.seq)
        self.order_changed()
        t.queued_at = time.time()

    def started_counts(self) -> dict[str, int]:
        """Tracks of each active job that left the queue (the fair-share key of ``queue_order``)."""
        return {jid: sum(t.status is not TrackStatus.queued for t in j.tracks) for jid, j in self.jobs.items()}

    def order_changed(self) -> None:
        """Something the queue's order depends on changed (a track joined or left the queue, a track's
        status or a job's presence changed): the next ``ordered`` or ``reorder`` orders it again.
        Every method here that makes such a change calls it."""
        self._stale = True

    def ordered(self) -> list[queue_order.QueueEntry]:
        """The queue in dispatch order (``queue_order.order``), made again only when it may have changed."""
        if self._stale:
            self._stale = False
            self._order = queue_order.order(self.queue.values(), self.started_counts())
        return list(self._order)

    def reorder(self) -> None:
        """The queue positions follow the order. Only a change of a position is a visible change: a pass
        that moved nothing wakes none of the waiting streams."""
        self.ordered()
        if self._placed is self._order:
            return
        self._placed = self._order
        positions = {(e.job_id, e.index): i + 1 for i, e in enumerate(self._order)}
        if positions != self.positions:
            self.positions = positions
            self.changes.touch()

    # ---- transitions ----------------------------------------------------------------------------
    async def claim(self, job: Job, tracks: list[Track], wanted: list[Track], fence: Fence) -> list[Track]:
        """Claim queued ``tracks`` of ``job`` in the store with the states in ``wanted`` (running, owned
        here, on the worker ``fence`` leases); returns the tracks won, with their new state. They leave
        the queue either way, but for a fence that failed (``LeaseLost``: nothing changed)."""
        async with self._write:
            won = await self.store.claim(wanted, fence)
            self.order_changed()
            for t, new in zip(tracks, wanted, strict=True):
                self.queue.pop(t.key, None)
                if t.index in won:
                    for name in STORED_TRACK_FIELDS:
                        setattr(t, name, getattr(new, name))
        self.changes.touch()
        if len(won) < len(tracks):
            self.resync(job.job_id)  # another dispatcher took some: learn their state
        return [t for t in tracks if t.index in won]

    async def change(self, t: Track, status: TrackStatus, fence: Fence | None = None, **fields: object) -> None:
        """Write the track's new state to the store, then keep it in memory.

        Compare-and-set on what this dispatcher last saw (under ``fence``, the lease of the attempt
        that writes): when another dispatcher changed the track first, or the lease is gone, nothing
        changes here, the job is read again, and ``StaleTrack`` (or ``LeaseLost``) is raised.
        """
        async with self._write:
            check_transition(t.status, status)
            new = dataclasses.replace(t, status=status, **fields)  # type: ignore[arg-type]
            ends = status.terminal and not t.status.terminal
            events = self.events.of(self.jobs.get(t.job_id), "track", new, self.positions) if ends else []
            try:
                await self.store.save_track(new, (t.status, t.owner), fence, events)
            except StaleTrack as exc:
                log.info("track %s/%d: not written (%s); reading it again", *t.key, exc)
                self.resync(t.job_id)
                raise
            for k in ("status", *fields):
                setattr(t, k, getattr(new, k))
            self.order_changed()
        self.changes.touch()

    async def progress_event(self, t: Track) -> None:
        """A running track moved: a ``progress`` event for its job, if it asked for them and none was
        written in the last 2 s (the store decides, for the whole fleet)."""
        job = self.jobs.get(t.job_id)
        if job is not None and self.events.progress_due(job):
            for event in self.events.of(job, "progress", positions=self.positions):
                await self.store.outbox.add_progress(event, PROGRESS_EVENT_SEC)

    def show_progress(self, t: Track, fields: dict[str, object]) -> bool:
        """A running track's progress from its worker (its status unchanged): in memory at once, in the
        store when its attempt writes it (throttled). Returns whether anything changed."""
        if all(getattr(t, k) == v for k, v in fields.items()):
            return False
        for k, v in fields.items():
            setattr(t, k, v)
        self.changes.touch()
        return True

    async def cancel_queued(self, job: Job) -> None:
        """The job's queued tracks leave the queue as cancelled; the others' positions move up."""
        for t in job.tracks:
            if t.status is TrackStatus.queued:
                try:
                    await self.change(t, TrackStatus.cancelled, finished_at=time.time())
                except StaleTrack:  # another dispatcher started it meanwhile: it stops on the job's cancel
                    continue
                self.queue.pop(t.key, None)
                self.order_changed()
        self.reorder()

    async def finish_if_done(self, job: Job) -> None:
        """A job whose tracks all ended is finished in the store (whichever dispatcher ran them)."""
        if not all(t.status.terminal for t in job.tracks):
            return
        now = job.end_time() or time.time()  # the last track's end: what the job's view showed until now
        if not await self.store.finish_job(job.job_id, now, self.events.of(job, "completed")):
            self.resync(job.job_id)  # memory is ahead of or behind the store: read it again
            return
        job.finished_at, job.terminal = job.finished_at or now, True
        self.events.forget(job.job_id)
        for t in job.tracks:
            self.metrics.finished.labels(str(t.worker_id), t.status.value).inc()
        self.jobs.pop(job.job_id, None)
        self.order_changed()
        log.info("job %s: %s", job.job_id, job_status((t.status for t in job.tracks), job.cancelled).value)
        self.changes.touch()

    # ---- following the shared store ------------------------------------------------------------
    def resync(self, job_id: str) -> None:
        """Read ``job_id`` (``*``: every active job) from the store again, soon (``sync`` does)."""
        self._dirty.add(job_id)
        self._dirty_event.set()

    async def sync(self, live: Container[Key]) -> list[Key]:
        """Wait for jobs to read again, read them and merge them; returns what ``merge`` returns."""
        await self._dirty_event.wait()
        self._dirty_event.clear()
        dirty, self._dirty = self._dirty, set()
        try:
            if "*" in dirty:
                return await self.reload(live)
            stored = {job_id: await self.store.load_job(job_id) for job_id in dirty}
        except BaseException:  # the store did not answer: these are read again next time
            self._dirty |= dirty
            self._dirty_event.set()
            raise
        stop: list[Key] = []
        for job_id, job in stored.items():
            stop += self.merge(job_id, job, live)
        self.reorder()
        return stop

    async def reload(self, live: Container[Key]) -> list[Key]:
        """Read every active job from the store again and merge it (after a pause, before dispatching
        again; as a safety net under the events); returns what ``merge`` returns."""
        stored = {j.job_id: j for j in await self.store.active_jobs()}
        stop: list[Key] = []
        for job_id in set(self.jobs) | set(stored):
            stop += self.merge(job_id, stored.get(job_id), live)
        self.reorder()
        return stop

    def merge(self, job_id: str, stored: Job | None, live: Container[Key]) -> list[Key]:
        """Take the store's state of a job into memory; the tracks in ``live`` (this dispatcher's running
        attempts) stay as they are. Returns those of them whose job was just cancelled at another
        dispatcher: the caller stops them."""
        mem = self.jobs.get(job_id)
        self.order_changed()  # any of what follows may change it
        if stored is None or stored.terminal:
            if mem is not None and not any(t.key in live for t in mem.tracks):
                for t in mem.tracks:
                    self.queue.pop(t.key, None)
                del self.jobs[job_id]
                self.changes.touch()
            return []
        if mem is None:
            self.add(stored)
            self.changes.touch()
            return []
        newly_cancelled = stored.cancelled and not mem.cancelled
        mem.cancelled, mem.started_at = stored.cancelled, stored.started_at
        for t, fresh in zip(mem.tracks, stored.tracks, strict=True):
            if t.key in live:
                self.queue.pop(t.key, None)  # ours and live: memory is the truth (a read from before our claim)
                continue
            for name in STORED_TRACK_FIELDS:
                setattr(t, name, getattr(fresh, name))
            if t.status is TrackStatus.queued and t.key not in self.queue:
                self.enqueue(mem, t)
            elif t.status is not TrackStatus.queued:
                self.queue.pop(t.key, None)
        self.changes.touch()
        return [t.key for t in mem.tracks if t.key in live] if newly_cancelled else []
