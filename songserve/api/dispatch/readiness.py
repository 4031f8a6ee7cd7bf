"""What the dispatcher answers ``/status``, ``/ready`` and ``/config``: its parts' states, read in one place.

Why a module of its own: readiness is the sum of faults that live in different parts, and each must
be named where a load balancer or an operator reads it: shutting down (the dispatcher), the job store
not answering in time (``store/probe.py``), a background loop that keeps failing (``loops.py``), the
results folder that cannot be written (``results/folder.py``), no worker ready (``pool.py``). The
first of them that holds is the 503's reason. ``/status`` shows the same parts as numbers; while the
store stalls it serves the last track counts read (``store_stalled`` says why) instead of waiting.

Both read the dispatcher through ``DispatcherParts`` (its attributes, nothing else), so this module
never imports ``dispatcher.py``.
"""

from __future__ import annotations

import time
from typing import Protocol

from songserve import __version__
from songserve.api.dispatch.attempts import Attempts
from songserve.api.dispatch.encodings import Encodings
from songserve.api.dispatch.loops import LoopHealth
from songserve.api.dispatch.membership import Membership
from songserve.api.dispatch.pool import WorkerPool
from songserve.api.dispatch.tracks import TrackBook
from songserve.api.jobs.facts import Fleet
from songserve.api.results.folder import ResultsFolder
from songserve.api.settings import DispatcherSettings
from songserve.api.store.probe import StoreProbe
from songserve.api.store.protocol import JobStore


class DispatcherParts(Protocol):
    """The dispatcher's parts these answers read (``Dispatcher`` has them as attributes)."""

    me: str
    store: JobStore
    accepting: bool
    started_at: float  # wall clock
    counts: dict[str, int]  # tracks by status in the store, as the reconcile loop last read them
    book: TrackBook
    pool: WorkerPool
    attempts: Attempts
    encodings: Encodings
    membership: Membership
    probe: StoreProbe
    results: ResultsFolder
    loops: LoopHealth


async def status(d: DispatcherParts) -> dict[str, object]:
    """The ``/status`` body."""
    book, workers = d.book, [w.public() for w in d.pool.workers]
    return {
        "total_gpus": len(workers),
        "idle_gpus": sum(w["status"] == "idle" for w in workers),
        "active_jobs": sum(1 for j in book.jobs.values() if any(t.status.running for t in j.tracks)),
        "queued_jobs": len({jid for jid, _ in book.queue}),
        "queued_tracks": len(book.queue),
        "running_tracks": len(d.attempts.running),
        "dispatcher_id": d.me,
        "dispatchers": sorted(d.membership.alive),
        "store": d.store.where,
        "store_stalled": d.probe.reason or None,
        # while the store stalls: the last counts read (store_stalled says why), not a 503
        "tracks_by_status": dict(d.counts) if d.probe.reason else await d.store.counts(),
        "uploads_by_status": dict(d.encodings.counts),  # as the reconcile loop last read them
        "encoding_uploads": sorted(d.encodings.running),  # here, now
        "uptime_sec": round(time.time() - d.started_at, 1),
        "accepting": d.accepting,
        "loops_failing": d.loops.failing(),
        "workers": workers,
    }


def ready(d: DispatcherParts) -> tuple[bool, str]:
    """Ready to serve: accepting, the store answering in time, no background loop failing, the
    results folder writable, and at least one worker ready; else False and the first reason."""
    if not d.accepting:
        return False, "The dispatcher is shutting down."
    if d.probe.reason:
        return False, f"The job store {d.store.where} is not answering in time: {d.probe.reason}."
    failing = d.loops.failing()
    if failing:
        name, error = next(iter(failing.items()))
        return False, f"The {name} loop keeps failing: {error}."
    if not d.results.writable:
        return (
            False,
            f"The results folder {d.results.root} cannot be written ({d.results.problem}); "
            "finished tracks wait and no new track starts until it can.",
        )
    if not workers_ready(d.pool):
        return False, "No worker is ready."
    return True, ""


def workers_ready(pool: WorkerPool) -> int:
    """Workers that are idle or busy (not offline, loading, stalled, degraded or in error)."""
    return sum(w.view.value in ("idle", "busy") for w in pool.workers)


def config(s: DispatcherSettings, fleet: Fleet) -> dict[str, object]:
    """``/config``: the models the workers offer, the request limits and defaults, the version."""
    return {
        "backbone_models": fleet.backbone_models,
        "superres_models": fleet.superres_models,
        "limits": {
            "duration_min": s.min_duration,
            "duration_max": s.max_duration,
            "max_tracks": s.max_tracks,
            "max_queue": s.max_queue,
            "max_lyrics_chars": s.max_lyrics_chars,
            "priority": [0, 9],
        },
        "defaults": {"num_tracks": 2, "duration": 3, "top_k_bb": 80, "temperature": 1.0, "top_k_sr": 10},
        "workers": fleet.workers,
        # workers whose /config says they run an untrained set, and the sentence the page shows then
        "untrained_workers": fleet.untrained,
        "notice": untrained_notice(fleet),
        # workers on the CPU: with every one there, the page offers a short song first (CPU_DURATION)
        "cpu_workers": fleet.on_cpu,
        "version": __version__,
    }


UNTRAINED = "tiny test model: the audio is noise of the right length"


def untrained_notice(fleet: Fleet) -> str | None:
    """What a listener must know before pressing Generate: the workers make noise (None: they do not say so)."""
    if not fleet.untrained:
        return None
    if fleet.untrained >= fleet.workers:
        return f"{UNTRAINED[0].upper()}{UNTRAINED[1:]}. Set CHECKPOINTS_DIR to a trained set to hear music."
    return f"{fleet.untrained} of {fleet.workers} workers run the {UNTRAINED}; a take they make is not music."
