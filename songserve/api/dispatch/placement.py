"""Which of the free workers a queued track goes to, and which more takes of its job go with it.

Most tracks take the first free worker (in the pool's order). A retried track does not go back to
the worker its last attempt failed on (``Track.avoid_worker``) while another worker can take it: it
waits for that one, even when the worker that failed it is the only one free (sent straight back, a
retry meets the same fault again: a worker whose downloads drip makes it wait out a second deadline).
A retake is pickier: only our workers can continue a song (a reference worker knows nothing of a
prefix), and among them one whose ``/health`` lists a KV
snapshot of the same original (``kv_snapshots.slots[].origin``) is preferred, since it prefills
only what the snapshot does not hold; for an edit (a repaint, a new opening) so is one that holds the
original's decoded audio (``kept_audio.origins``), where it decodes only the chunks it changes (one
that holds both before one that holds either). A busy holder is not waited for: any free worker gives the
same song, only the prefill is longer. A repaint of several parts goes only to a worker whose
``/config`` says it writes that many (``repaint_parts``): an older worker of ours reads the first part
alone and would keep the others unchanged. A take with a LoRA adapter goes only to a worker whose
``/health`` lists it among the adapters it can load (``adapters.available``), one that holds it in
a slot (``adapters.resident``) first, for the same reason: it starts without loading it.

``pack`` (``PACK_TRACKS``): a job's queued takes go to one worker as one batch when more are
queued than workers are free (``auto``), always, or never; retakes of one prefix always go
together, so the prefix is prefilled once.

``plan`` does this for the whole queue at once and returns what it decided (``Plan``: which takes go
to which worker, and why each other queued track waits); it awaits nothing and changes nothing, so a
dispatch pass is "gather the facts, plan, apply" (``Dispatcher._dispatch_pass``), and the plan is
tested over tables of cases without an event loop.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from songserve.api.dispatch.pool import WorkerHandle
from songserve.api.dispatch.queue_order import QueueEntry
from songserve.api.dispatch.retakes import origin_of
from songserve.api.jobs.records import Job, Key, Track
from songserve.api.jobs.states import TrackStatus

NO_WORKER = "no free worker"
RESULTS_UNWRITABLE = "the results folder cannot be written (see /ready)"
NOT_ENCODED = "its upload is not encoded yet"
NO_PREFIX = "no free worker can continue a song (a reference worker knows no prefix)"
NOT_THERE_AGAIN = "it waits for a worker other than the one its last attempt failed on"
NO_ADAPTER = "no free worker can load its adapter"
NO_PARTS = "no free worker repaints several parts in one take (an older worker of ours repaints one)"


def serves_adapter(w: WorkerHandle, name: str) -> bool:
    """``w`` can make a take with adapter ``name`` ("" none: every worker can)."""
    return not name or (w.health.adapters is not None and name in w.health.adapters.available)


def holds_adapter(w: WorkerHandle, name: str) -> bool:
    """``w``'s latest health lists adapter ``name`` in one of its slots."""
    return w.health.adapters is not None and any(a.name == name for a in w.health.adapters.resident)


def holds_snapshot(w: WorkerHandle, origin: str) -> bool:
    """The worker's latest health lists a KV snapshot of ``origin``: a continuation of it prefills less there."""
    slots = (w.health.kv_snapshots or {}).get("slots") or []
    return any(isinstance(s, dict) and s.get("origin") == origin for s in slots)


def holds_audio(w: WorkerHandle, origin: str) -> bool:
    """The worker's latest health lists the decoded audio of ``origin``: an edit of it decodes only the
    chunks it changes there."""
    return origin in ((w.health.kept_audio or {}).get("origins") or [])


def parts_of(job: Job) -> int:
    """How many parts ``job`` repaints in each take (1 for any other job)."""
    cf = job.request.continue_from
    return len(cf.parts) if cf is not None and cf.parts is not None else 1


def could_take(w: WorkerHandle, job: Job) -> bool:
    """``w`` takes tracks of ``job`` from this dispatcher, now or once its current work ends: online, leased
    here, in rotation (not benched, draining, in error or stalled), and able to run it."""
    if not (w.online and w.leased and not w.handing_back and not w.degraded_reason and not w.stalled):
        return False
    if w.health.status in ("error", "stalled") or not w.health.accepting:
        return False
    return (job.request.continue_from is None or not w.client.reference) and w.repaint_parts >= parts_of(job)


def pick(free: list[WorkerHandle], job: Job, t: Track, fleet: Sequence[WorkerHandle] = ()) -> WorkerHandle | None:
    """The worker for ``t`` among ``free`` (non-empty), or None when none of them can run it, or when only
    the worker ``t`` last failed on is free and another of ``fleet`` (the pool) could take it later."""
    candidates = free
    cf = job.request.continue_from
    adapter, _ = job.request.take_adapter(t.index)
    if adapter:
        candidates = [w for w in candidates if serves_adapter(w, adapter)]
        holders = [w for w in candidates if holds_adapter(w, adapter)]
        candidates = holders + [w for w in candidates if w not in holders]
    if cf is not None:
        candidates = [w for w in candidates if not w.client.reference and w.repaint_parts >= parts_of(job)]
        origin, edit = origin_of(cf), cf.edits()
        # the workers that hold more of what it reuses first (a snapshot; an edit, also the audio), else in order
        candidates = sorted(candidates, key=lambda w: -holds_snapshot(w, origin) - (edit and holds_audio(w, origin)))
    if not candidates:
        return None
    chosen = next((w for w in candidates if w.worker_id != t.avoid_worker), None)
    if chosen is not None:
        return chosen
    if any(w.worker_id != t.avoid_worker and could_take(w, job) and serves_adapter(w, adapter) for w in fleet):
        return None  # wait for that one
    return candidates[0]


def pack(job: Job, w: WorkerHandle, mode: str, queued_after: int, free_after: int, taken: set[Key]) -> list[Track]:
    """More queued takes of ``job`` for ``w`` to run in the same batch (may be none)."""
    if job.request.continue_from is not None and mode == "auto":
        mode = "always"  # retakes of one prefix: one batch prefills it once
    if w.max_batch <= 1 or mode == "never" or (mode == "auto" and queued_after <= free_after):
        return []
    more = [
        x
        for x in job.tracks
        if x.status is TrackStatus.queued
        and (job.job_id, x.index) not in taken
        and serves_adapter(w, job.request.take_adapter(x.index)[0])  # takes of several adapters batch together
    ]
    room = w.max_batch - 1
    if mode == "auto":
        room = min(room, queued_after - free_after)  # leave the free workers their share
    return more[: max(0, room)]


def repaints(fleet: Sequence[WorkerHandle], parts: int) -> bool:
    """Whether a repaint of ``parts`` parts can ever be placed: no worker known yet, or one of ours that
    writes that many, or one of ours whose ``/config`` is not read yet (it may)."""
    ours = [w for w in fleet if not w.client.reference]
    return not fleet or any(w.config is None or w.repaint_parts >= parts for w in ours)


@dataclass(frozen=True)
class Assignment:
    """Takes of one job to start on one worker as one attempt (the first is the one whose turn it was)."""

    job: Job
    tracks: list[Track]
    worker: WorkerHandle
    missing: str = ""  # why a continuation's kept frames never will be there (its takes fail so)

    @property
    def keys(self) -> list[Key]:
        return [t.key for t in self.tracks]


@dataclass(frozen=True)
class Plan:
    assignments: list[Assignment] = field(default_factory=list)
    waiting: dict[Key, str] = field(default_factory=dict)  # queued tracks not started now, and why


@dataclass(frozen=True)
class PlanFacts:
    """What a plan needs besides the queue and the free workers."""

    pack_tracks: str  # ``PACK_TRACKS``: auto, always, never
    fleet: Sequence[WorkerHandle] = ()  # the whole pool: a worker busy now may take a track later
    frames: Mapping[str, str | None] = field(default_factory=dict)  # job id → ``Encodings.frames_for``'s
    # answer for a continued upload ("" or absent: ready or not needed; None: still encoding)


def plan(
    ordered: Sequence[QueueEntry],
    jobs: Mapping[str, Job],
    queued: Collection[Key],
    free: Sequence[WorkerHandle],
    facts: PlanFacts,
    taken: Collection[Key] = (),
) -> Plan:
    """Pair ``ordered`` (the queue in dispatch order) with ``free`` (the workers that may take a track
    now, in preference order). Entries no longer in ``queued`` (another dispatcher's now), of a job
    no longer active, not queued in memory or in ``taken`` (tried already in this pass) are skipped;
    every other one is assigned or waits with its reason."""
    left = list(free)
    done: set[Key] = set(taken)
    out = Plan()
    for entry in ordered:
        key = (entry.job_id, entry.index)
        job = jobs.get(entry.job_id)
        if key in done or key not in queued or job is None:
            continue
        t = job.tracks[entry.index]
        if t.status is not TrackStatus.queued:
            continue
        if not left:
            out.waiting[key] = NO_WORKER
            continue
        missing = facts.frames.get(job.job_id, "")
        if missing is None:
            out.waiting[key] = NOT_ENCODED
            continue
        w = pick(left, job, t, facts.fleet)
        if w is None:
            cf = job.request.continue_from
            adapter = job.request.take_adapter(t.index)[0]
            ours = any(not x.client.reference for x in left)
            if not any(serves_adapter(x, adapter) for x in left):
                out.waiting[key] = NO_ADAPTER
            elif ours and not any(x.repaint_parts >= parts_of(job) for x in left):
                out.waiting[key] = NO_PARTS
            else:
                out.waiting[key] = NO_PREFIX if cf is not None and not ours else NOT_THERE_AGAIN
            continue
        more = pack(job, w, facts.pack_tracks, len(ordered) - len(done) - 1, len(left) - 1, done | {key})
        tracks = [t, *more]
        done.update(x.key for x in tracks)
        out.assignments.append(Assignment(job, tracks, w, missing))
        left.remove(w)
    return out
