"""The one phase table: which track status a worker's phase means, and what it weighs in the overall percent.

A worker reports the phase it is in (``WorkerPhase`` words) and its percent within that phase; a
running track's status follows the phase (``status_of_phase``), and the overall percent a client
sees is the phase's span of 1–99 scaled by that percent (``overall_progress``):

    loading_backbone, backbone     generating   1 %, then 69 points
    loading_superres, superres     superres    70 %, then 20 points
    loading_decoder, decoding      decoding    90 %, then  9 points
"""

from __future__ import annotations

from songserve.api.jobs.records import Track
from songserve.api.jobs.states import TrackStatus

# worker phase → (track status, start of its span in the overall %, span)
PHASES = {
    "loading_backbone": (TrackStatus.generating, 1, 0),
    "backbone": (TrackStatus.generating, 1, 69),
    "loading_superres": (TrackStatus.superres, 70, 0),
    "superres": (TrackStatus.superres, 70, 20),
    "loading_decoder": (TrackStatus.decoding, 90, 0),
    "decoding": (TrackStatus.decoding, 90, 9),
}


def status_of_phase(phase: str) -> TrackStatus:
    """The track status a worker phase means (unknown phases count as the backbone's)."""
    return PHASES.get(phase, (TrackStatus.generating, 1, 0))[0]


def overall_progress(t: Track) -> int:
    """0 while queued, 1–99 while running (from the worker's phase and its percent), 100 when done."""
    if t.status is TrackStatus.done:
        return 100
    if not t.status.running:
        return 0
    _, start, span = PHASES.get(t.worker_phase, (t.status, 1, 0))
    return max(1, min(99, start + span * t.phase_progress // 100))
