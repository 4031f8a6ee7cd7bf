"""The worker pool: who the workers are, what the dispatcher believes of each, and the health poll.

Two sources of truth, kept apart:
- ``health``: the worker's own last ``/health`` answer (a ``WorkerHealth``), never edited here;
- the dispatcher's belief, in the handle's own fields: ``assigned`` (the tracks it gave the worker
  by task id, several when a job's takes run as one batch: the one truth for "busy"), ``online``,
  ``stalled`` (our watchdog's verdict) and ``answered`` (the worker answered its last task after
  the latest poll, so a stale "busy" in ``health`` no longer holds).

The view a client sees (``/status``) is derived from both:

    offline   not answering its health poll, or its connection broke
    loading   online, still loading its models
    idle      online, ready, nothing assigned          (the only state that takes a track, and only
              from the dispatcher holding its lease: ``leased``)
    busy      a track is assigned, or it reports busy
    error     it reports its model thread died or loading failed
    stalled   it reports a stalled model thread, or our watchdog saw no progress
    degraded  online but out of rotation: benched after failing tracks for reasons of its own
              several times in a row, or its output disk is nearly full

The breaker that benches a worker (``track_failed``) counts what the worker did, not what it said:
environment errors (its disk, memory, writes), answers that are not the contract, and result files
that are missing, short, damaged, oversize or late. ``BENCH_AFTER_FAILURES`` in a row bench it for
``BENCH_SEC``; after the bench one more failure benches it again (half-open), each bench twice as
long as the last (up to ``MAX_BENCH_FACTOR`` times); a finished track closes the breaker. Among
the workers that may take a track, those with failures in their current run come last.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum

from songserve.api.jobs.facts import AdapterOffer
from songserve.api.jobs.records import Key
from songserve.api.store.members import WorkerRow
from songserve.api.workers.client import WorkerClient, WorkerHttp
from songserve.api.workers.outcomes import WorkerUnreachable
from songserve.schemas import TakeHealth, WorkerConfig, WorkerHealth
from songserve.schemas.worker import AdapterHeld

log = logging.getLogger(__name__)
MAX_BENCH_FACTOR = 8  # a worker that keeps failing after its bench is benched up to 8 × BENCH_SEC
COPIES_IN_FLIGHT = 1  # a worker gets a new track while at most this many of its results are being copied


class WorkerView(StrEnum):
    offline = "offline"
    loading = "loading"
    idle = "idle"
    busy = "busy"
    error = "error"
    stalled = "stalled"
    degraded = "degraded"


@dataclass
class WorkerHandle:
    worker_id: int
    client: WorkerClient
    online: bool = False
    failures: int = 0
    health: WorkerHealth = field(default_factory=WorkerHealth)
    config: WorkerConfig | None = None  # its /config, read when it comes online
    assigned: dict[str, Key] = field(default_factory=dict)  # task id → the track it runs
    stalled: bool = False  # our watchdog's verdict for the assigned task
    answered: bool = False  # answered its last task since the latest poll: idle, whatever health says
    health_sent_at: float = 0.0  # monotonic time the latest health answer was asked for
    trust_after: float = 0.0  # health asked for before this (monotonic) is stale: we stopped a task since
    last_progress_at: float = 0.0  # monotonic
    faults: int = 0  # tracks failed in a row for reasons of its own (environment, protocol, files)
    benches: int = 0  # benches since its last finished track: each one twice as long
    benched_until: float = 0.0  # monotonic
    bench_reason: str = ""
    collecting: int = 0  # attempts whose results are being copied from it now
    announced: bool = False  # it joined by announcing itself (else a dispatcher's WORKER_URLS lists it)
    leased: bool = False  # this dispatcher holds its lease: the only one that sends it tasks now
    lease_epoch: int = 0  # the epoch of the lease held here (0: none): every write for its tracks carries it
    lease_valid_until: float = 0.0  # monotonic: the lease's last renewal was sent + LEASE_TTL_SEC (our own bound)
    lease_owner: str | None = None  # who held its lease at the last membership check
    handing_back: bool = False  # over this dispatcher's fair share: no new tasks, its lease goes back once idle
    encoding: str | None = None  # the upload it encodes for us now (``encodings.py``): busy, as with a track
    _progress_mark: tuple[object, ...] = ()

    @property
    def url(self) -> str:
        return self.client.url

    @property
    def view(self) -> WorkerView:
        if not self.online:
            return WorkerView.offline
        reported = self.health.status
        if reported == "error":
            return WorkerView.error
        if reported == "stalled" or self.stalled:
            return WorkerView.stalled
        if self.assigned or self.encoding or (reported == "busy" and not self.answered):
            return WorkerView.busy
        if self.degraded_reason:
            return WorkerView.degraded
        if reported == "initializing":
            return WorkerView.loading
        return WorkerView.idle

    @property
    def available(self) -> bool:
        reported = self.health.status
        fresh = self.health_sent_at >= self.trust_after
        ready = (reported == "idle" and fresh) or (reported == "busy" and self.answered)
        healthy = ready and self.health.accepting and not self.degraded_reason
        lease = self.leased and not self.handing_back and time.monotonic() < self.lease_valid_until
        # A worker whose copies lag gets no more work: a result it cannot deliver is not multiplied.
        copying = self.collecting > COPIES_IN_FLIGHT
        idle = not self.assigned and self.encoding is None
        return lease and self.online and idle and healthy and not copying

    @property
    def can_encode(self) -> bool:
        """It says it encodes audio (our worker with an encoder; never a reference worker)."""
        return self.config is not None and self.config.encoder and not self.client.reference

    def encoded(self, upload_id: str, answered: bool) -> None:
        """Its encoding of ``upload_id`` ended; ``answered``: it said so, so its model thread is free now."""
        if self.encoding == upload_id:
            self.encoding = None
            if not answered:
                self.trust_after = time.monotonic()
            elif not self.assigned:
                self.answered = True

    @property
    def repaint_parts(self) -> int:
        """The most parts of one repaint it writes (1: a worker that reads one part alone)."""
        return self.config.repaint_parts if self.config is not None and not self.client.reference else 1

    @property
    def max_batch(self) -> int:
        """Takes of one request it runs as one batch (1: no batch endpoint, e.g. the reference's)."""
        return max(1, self.config.max_batch) if self.config is not None and not self.client.reference else 1

    @property
    def degraded_reason(self) -> str:
        if time.monotonic() < self.benched_until:
            return self.bench_reason
        if self.health.disk_low:
            return f"its output disk is nearly full ({self.health.disk_free_mb} MB free)"
        return ""

    def track_failed(self, its_own: bool, bench_after: int, bench_sec: float, reason: str) -> bool:
        """Count a failed track (``its_own``: the worker's fault, else the track's, which ends a run of
        faults); returns True when this failure benches the worker."""
        if not its_own:
            self.faults = 0
            return False
        if time.monotonic() < self.benched_until:  # work given before the bench: already out, not again
            return False
        self.faults += 1
        if self.faults < bench_after:
            return False
        self.faults = bench_after - 1  # half-open: once the bench is over, one more failure benches it again
        self.benches += 1
        sec = bench_sec * min(MAX_BENCH_FACTOR, 2 ** (self.benches - 1))
        self.benched_until = time.monotonic() + sec
        self.bench_reason = f"benched for {sec:.0f}s after {bench_after} failures of its own in a row: {reason}"
        log.warning("worker %d: %s", self.worker_id, self.bench_reason)
        return True

    def track_succeeded(self) -> None:
        self.faults = self.benches = 0

    def progress_of(self, task_id: str | None) -> TakeHealth | None:
        """The worker's health for ``task_id`` while it runs it, else None.

        A reference worker reports no task id: while we hold it for ``task_id`` and it reports
        busy, the task it runs is ours (it gets one task at a time from us).
        """
        h = self.health
        if task_id is None or h.phase == "idle":
            return None
        if self.client.reference:
            if task_id in self.assigned and h.status == "busy":
                return TakeHealth(
                    task_id=task_id, phase=h.phase, progress=h.progress, progress_detail=h.progress_detail
                )
            return None
        return h.take(task_id)

    def assign(self, key: Key, task_id: str) -> None:
        if not self.assigned:
            self.stalled = False
            self.last_progress_at = time.monotonic()
            self._progress_mark = ()
        self.assigned[task_id] = key

    def release(self, task_id: str | None, answered: bool = True) -> None:
        """Free the worker from ``task_id``; a no-op if it has moved on to another task.

        ``answered``: the worker answered the task, so its model thread is free now. Otherwise (we
        stopped the task, or it said it was busy) it is used again only after a newer health poll.
        """
        if task_id not in self.assigned:
            return
        del self.assigned[task_id]
        if not answered:
            self.trust_after = time.monotonic()
        if not self.assigned:
            self.stalled, self.answered = False, answered

    def mark_unreachable(self) -> None:
        """Its connection broke: not used again until a health poll answers."""
        self.online = False

    def mark_stalled(self) -> None:
        """Our watchdog saw no progress of its tasks: stalled until it is given a task again."""
        self.stalled = True

    def start_encoding(self, upload_id: str) -> None:
        """It encodes ``upload_id`` for us now: busy, as with a track, until ``encoded``."""
        self.encoding = upload_id

    def copy_started(self) -> None:
        """A result of its attempt is being copied from it (it gets new work while few are)."""
        self.collecting += 1

    def copy_ended(self) -> None:
        self.collecting -= 1

    # ---- its lease, as the membership learns it (read by the dispatch pass and the attempts) ----
    def lease_held(self, epoch: int, owner: str) -> None:
        """This dispatcher (``owner``) holds its lease under ``epoch``."""
        self.leased, self.lease_epoch, self.lease_owner = True, epoch, owner

    def lease_gone(self) -> None:
        """Its lease is not held here (lost, given back, never taken): nothing is sent to it from here."""
        self.leased, self.lease_epoch, self.lease_valid_until, self.handing_back = False, 0, 0.0, False

    def lease_usable_until(self, until: float) -> None:
        """Tasks go to it until ``until`` (monotonic: the last renewal + TTL); 0: not before the next renewal."""
        self.lease_valid_until = until if self.leased else 0.0

    def suspend_lease(self) -> None:
        """A write under its lease was refused: nothing is sent to it before the membership reads its leases."""
        self.lease_valid_until = 0.0

    def hand_back(self, over_share: bool) -> None:
        """Over this dispatcher's fair share (``over_share``): no new tasks, its lease goes back once idle."""
        self.handing_back = over_share

    def holds_upload(self, name: str, digest: str) -> None:
        """It took an uploaded adapter (its answer to ``PUT /adapters``): offered at once, before its
        next ``/health`` says so itself."""
        held = self.health.adapters
        if held is not None:
            held.uploaded = {**held.uploaded, name: digest}
            held.available = sorted({*held.available, name})

    def dropped_upload(self, name: str) -> None:
        """It deleted an uploaded adapter (its answer to ``DELETE /adapters``): no longer offered."""
        held = self.health.adapters
        if held is not None and name in held.uploaded:
            held.uploaded = {k: v for k, v in held.uploaded.items() if k != name}
            held.available = [n for n in held.available if n != name]
            held.resident = [r for r in held.resident if r.name != name]

    def note_health(self, health: WorkerHealth, sent_at: float) -> None:
        self.health, self.online, self.failures, self.answered = health, True, 0, False
        self.health_sent_at = sent_at
        takes = [self.progress_of(task_id) for task_id in self.assigned]
        mark = tuple((t.phase, t.progress, t.progress_detail) for t in takes if t is not None)
        if mark and mark != self._progress_mark:
            self._progress_mark = mark
            self.last_progress_at = time.monotonic()

    def public(self) -> dict[str, object]:
        h = self.health
        return {
            "worker_id": self.worker_id,
            "url": self.url,
            "status": self.view.value,
            "phase": h.phase if self.online else "offline",
            # a CPU worker has no GPU: null, not the id the launcher numbered it with
            "gpu_id": None if h.device == "cpu" else h.gpu_id if h.gpu_id is not None else self.worker_id,
            "device": h.device,
            "runtime_mode": h.runtime_mode,
            "progress": h.progress,
            "task_id": next(iter(self.assigned), None) or (f"upload-{self.encoding}" if self.encoding else None),
            "task_ids": list(self.assigned),
            "tasks_done": h.tasks_done,
            "kind": self.client.kind,
            "degraded_reason": self.degraded_reason or None,
            "disk_free_mb": h.disk_free_mb,
            "joined": "announced" if self.announced else "configured",
            "leased_by": self.lease_owner,
        }


class WorkerPool:
    """The workers of the shared registry (``sync``), polled for health; each change reported to ``on_change``."""

    def __init__(
        self,
        http: WorkerHttp,
        interval: float,
        offline_after: int,
        on_change: Callable[[WorkerHandle, WorkerView], Awaitable[None]],
    ) -> None:
        self.http = http
        self._by_id: dict[int, WorkerHandle] = {}
        self.interval = interval
        self.offline_after = offline_after
        self.on_change = on_change
        self._task: asyncio.Task[None] | None = None

    @property
    def workers(self) -> list[WorkerHandle]:
        return list(self._by_id.values())

    def by_id(self, worker_id: int) -> WorkerHandle | None:
        return self._by_id.get(worker_id)

    def sync(self, rows: list[WorkerRow]) -> tuple[list[WorkerHandle], list[WorkerHandle]]:
        """Follow the registry: returns the workers that joined and those that left since the last call."""
        live = {r.worker_id: r for r in rows}
        left = [w for wid, w in self._by_id.items() if wid not in live or live[wid].url != w.url]
        for w in left:
            del self._by_id[w.worker_id]
            log.info("worker %d (%s) left the pool", w.worker_id, w.url)
        joined: list[WorkerHandle] = []
        for r in rows:
            found = self._by_id.get(r.worker_id)
            if found is None:
                found = self._by_id[r.worker_id] = WorkerHandle(r.worker_id, WorkerClient(self.http, r.url))
                joined.append(found)
                log.info(
                    "worker %d (%s) joined the pool (%s)",
                    r.worker_id,
                    r.url,
                    "announced" if r.announced else "configured",
                )
            found.announced, found.lease_owner = r.announced, r.lease_owner
        self._by_id = dict(sorted(self._by_id.items()))
        return joined, left

    def available(self) -> list[WorkerHandle]:
        """Workers that may take a track now: those without failures in their current run first."""
        return sorted((w for w in self.workers if w.available), key=lambda w: w.faults)

    def online_count(self) -> int:
        return sum(w.online for w in self.workers)

    def context_minutes(self) -> tuple[int, int] | None:
        """(the longest backbone context among the workers, audio tokens per minute), when they say."""
        known = [
            (w.config.max_sequence_length, w.config.tokens_per_minute)
            for w in self.workers
            if w.config is not None and w.config.max_sequence_length and w.config.tokens_per_minute
        ]
        return max(known) if known else None

    def untrained(self) -> int:
        """Workers whose ``/config`` says they run an untrained set (the tiny set: noise of the right length)."""
        return sum(w.config is not None and w.config.untrained for w in self.workers)

    def on_cpu(self) -> int:
        """Workers whose ``/config`` names the CPU as their device (the page's default length is short then)."""
        return sum(w.config is not None and (w.config.device or "").startswith("cpu") for w in self.workers)

    def adapters(self) -> list[AdapterOffer]:
        """The LoRA adapters the online workers can load (their ``/health``), by name."""
        workers: dict[str, list[int]] = {}
        resident: dict[str, list[int]] = {}
        uploaded: set[str] = set()
        held_as: dict[str, AdapterHeld] = {}  # what a worker holding it says of it (the last one asked)
        for w in self.workers:
            held = w.health.adapters
            if not w.online or held is None:
                continue
            for name in held.available:
                workers.setdefault(name, []).append(w.worker_id)
            uploaded.update(held.uploaded)
            for a in held.resident:
                resident.setdefault(a.name, []).append(w.worker_id)
                held_as[a.name] = a
        offers = []
        for name in sorted(workers.keys() | resident.keys()):
            said = held_as.get(name)
            rank, targets, size = (said.rank, list(said.targets), said.bytes) if said is not None else (None, [], None)
            offers.append(
                AdapterOffer(name, workers.get(name, []), resident.get(name, []), rank, targets, size, name in uploaded)
            )
        return offers

    def models(self, kind: str) -> list[str]:
        """Model names the workers offer, in first-seen order (``kind`` is backbone or superres)."""
        names: list[str] = []
        for w in self.workers:
            source = w.config if w.config is not None else w.health
            for n in source.backbone_models if kind == "backbone" else source.superres_models:
                if n not in names:
                    names.append(n)
        return names

    async def poll_once(self) -> None:
        await asyncio.gather(*(self.poll(w) for w in self.workers))

    async def poll(self, w: WorkerHandle) -> None:
        before, sent_at = w.view, time.monotonic()
        try:
            w.note_health(await w.client.health(timeout=max(2.0, 2 * self.interval)), sent_at)
        except WorkerUnreachable as exc:
            w.failures += 1
            if w.online and w.failures >= self.offline_after:
                log.warning("worker %d (%s) offline: %s", w.worker_id, w.url, exc)
                w.online = False
        if w.online and (w.config is None or before is WorkerView.offline):
            try:
                w.config = await w.client.config()
            except WorkerUnreachable as exc:  # models fall back to its health; asked again next poll
                log.warning("worker %d: no config (%s)", w.worker_id, exc)
        if w.view != before:
            log.info("worker %d: %s → %s (%s worker)", w.worker_id, before.value, w.view.value, w.client.kind)
        try:
            await self.on_change(w, before)
        except Exception:  # e.g. the store could not write a phase change: the next poll tries again
            log.exception("worker %d: applying its health failed", w.worker_id)

    async def run(self) -> None:
        while True:
            try:
                await self.poll_once()
            except Exception:  # one bad iteration must not end the poll for good
                log.exception("health poll failed; retrying")
            await asyncio.sleep(self.interval)

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="health-poll")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
