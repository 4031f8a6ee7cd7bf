"""How a job and its tracks look on the wire: progress, phase lines, status words.

The overall percent comes from the one phase table (``phases.py``); here only the words a client reads.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from songserve.api.jobs.facts import Waiting
from songserve.api.jobs.phases import overall_progress
from songserve.api.jobs.records import Job, Key, Track
from songserve.api.jobs.states import TrackStatus, job_status
from songserve.schemas import JobView, TrackFiles, TrackView

TOKENS = re.compile(r"^\s*(\d+)\s*/\s*\d+\s+tokens\s*$")  # the reference worker's progress_detail

PHASE_TITLES = {
    TrackStatus.generating: "Backbone generating",
    TrackStatus.superres: "Super-Resolution Generating",
}


def phase_display(t: Track, queue_position: int) -> str:
    if t.status is TrackStatus.queued:
        return f"Queued · Position #{queue_position}" if queue_position else "Queued"
    if not t.status.running:
        return t.status.value.capitalize()  # Done, Error, Cancelled
    if t.worker_phase.startswith("loading"):
        return f"Loading {t.worker_phase.split('_', 1)[1]} model..."
    title = PHASE_TITLES.get(t.status)
    if title is None:
        return "Decoding audio..."
    detail = _backbone_detail(t) if t.status is TrackStatus.generating else ""
    return f"{title} · {t.phase_progress}%{detail}"


def _backbone_detail(t: Track) -> str:
    """`` · 180 tok/s · 1100 tokens`` from the worker's "N/M tokens" and its rate (api.md's line)."""
    m = TOKENS.match(t.phase_detail)
    if m is None:
        return f" · {t.phase_detail}" if t.phase_detail else ""
    rate = f" · {t.phase_rate:.0f} tok/s" if t.phase_rate else ""
    return f"{rate} · {int(m.group(1))} tokens"


STOPPING = "Cancelled · stopping on its worker"


def track_view(job: Job, t: Track, queue_position: int, waiting: str | None = None) -> TrackView:
    done = t.status is TrackStatus.done
    base = f"/job/{job.job_id}/track/{t.index}"
    # A cancelled job's running track is cancelled from the moment of the cancel (its worker is told to
    # stop and its result is not kept), not "generating" under a job that says "cancelled".
    stopping = job.cancelled and t.status.running
    return TrackView(
        index=t.index,
        status=TrackStatus.cancelled.value if stopping else t.status.value,
        progress=overall_progress(t),
        phase_display=STOPPING if stopping else phase_display(t, queue_position),
        worker_id=t.worker_id if t.status.running else -1 if not done else t.worker_id,
        worker_phase=t.worker_phase if t.status.running else "idle",
        duration_sec=t.duration_sec,
        error=t.error,
        seed=t.seed,
        attempts=t.attempts,
        queue_position=queue_position,
        waiting=waiting if t.status is TrackStatus.queued and not job.cancelled else None,
        files=_files(base, t) if done else None,
        metadata=t.metadata,
        preview_sec=t.preview_sec if t.status.running else 0.0,
        # queued, running or done: something to hear; an ended track without audio has no stream
        stream_url=f"{base}/stream" if done or not (t.status.terminal or stopping) else None,
    )


def _files(base: str, t: Track) -> TrackFiles:
    kept = t.metadata.get("file_bytes") or {}
    return TrackFiles(mp3=f"{base}/mp3", wav=f"{base}/wav", codes=f"{base}/codes" if "codes" in kept else None)


def job_view(job: Job, positions: Mapping[Key, int], eta: float | None, waiting: Waiting | None = None) -> JobView:
    why = waiting.of if waiting is not None else lambda key: None
    tracks = [track_view(job, t, positions.get(t.key, 0), why(t.key)) for t in job.tracks]
    queued = [tv.queue_position for tv in tracks if tv.queue_position]
    return JobView(
        job_id=job.job_id,
        status=job_status((t.status for t in job.tracks), job.cancelled).value,
        queue_position=min(queued) if queued else 0,
        cleaned_lyrics=job.cleaned_lyrics,
        created_at=job.created_at,
        started_at=job.start_time(),
        finished_at=job.end_time(),
        eta_sec=eta,
        priority=job.priority,
        tracks=tracks,
    )
