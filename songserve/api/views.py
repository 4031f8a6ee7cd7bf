"""How a job and its tracks look on the wire: progress, phase lines, status words."""

from __future__ import annotations

from songserve.api.states import TrackStatus, job_status
from songserve.api.store import Job, Track
from songserve.schemas import JobView, TrackFiles, TrackView

# Share of the overall progress bar each worker phase covers: (status, start %, span %).
PHASES = {
    "loading_backbone": (TrackStatus.generating, 1, 0),
    "backbone": (TrackStatus.generating, 1, 69),
    "loading_superres": (TrackStatus.superres, 70, 0),
    "superres": (TrackStatus.superres, 70, 20),
    "loading_decoder": (TrackStatus.decoding, 90, 0),
    "decoding": (TrackStatus.decoding, 90, 9),
}


def track_from_phase(phase: str, worker_progress: int) -> tuple[TrackStatus, int]:
    status, start, span = PHASES.get(phase, (TrackStatus.generating, 1, 0))
    return status, max(1, min(99, start + span * worker_progress // 100))


def phase_display(t: Track, queue_position: int) -> str:
    if t.status is TrackStatus.queued:
        return f"Queued · Position #{queue_position}" if queue_position else "Queued"
    if t.status is TrackStatus.done:
        return "Done"
    if t.status is TrackStatus.error:
        return "Error"
    if t.status is TrackStatus.cancelled:
        return "Cancelled"
    phase = t.worker_phase
    if phase.startswith("loading"):
        return f"Loading {phase.split('_', 1)[1]} model..."
    if t.status is TrackStatus.generating:
        inner = max(0, (t.progress - 1) * 100 // 69)
        detail = f" · {t.phase_detail}" if t.phase_detail else ""
        return f"Backbone generating · {inner}%{detail}"
    if t.status is TrackStatus.superres:
        return f"Super-Resolution Generating · {max(0, (t.progress - 70) * 100 // 20)}%"
    return "Decoding audio..."


def track_view(job: Job, t: Track, queue_position: int) -> TrackView:
    done = t.status is TrackStatus.done
    base = f"/job/{job.job_id}/track/{t.index}"
    return TrackView(
        index=t.index,
        status=t.status.value,
        progress=100 if done else (0 if t.status is TrackStatus.queued else t.progress),
        phase_display=phase_display(t, queue_position),
        worker_id=t.worker_id if t.status.running else -1 if not done else t.worker_id,
        worker_phase=t.worker_phase if t.status.running else "idle",
        duration_sec=t.duration_sec,
        error=t.error,
        seed=t.seed,
        attempts=t.attempts,
        queue_position=queue_position,
        files=TrackFiles(mp3=f"{base}/mp3", wav=f"{base}/wav") if done else None,
        metadata=t.metadata,
    )


def job_view(job: Job, positions: dict[tuple[str, int], int], eta: float | None) -> JobView:
    tracks = [track_view(job, t, positions.get((job.job_id, t.index), 0)) for t in job.tracks]
    queued = [tv.queue_position for tv in tracks if tv.queue_position]
    return JobView(
        job_id=job.job_id,
        status=job_status((t.status for t in job.tracks), job.cancelled).value,
        queue_position=min(queued) if queued else 0,
        cleaned_lyrics=job.cleaned_lyrics,
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        eta_sec=eta,
        priority=job.priority,
        tracks=tracks,
    )
