"""Speed history and estimates: ETA from measured seconds of work per second of audio.

Fed by every finished track (per backbone model), seeded from the store at start-up.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from collections.abc import Mapping

from songserve.api.jobs.phases import overall_progress
from songserve.api.jobs.records import Job, Key


class SpeedHistory:
    def __init__(self, window: int = 50) -> None:
        self._ratios: dict[str, deque[float]] = defaultdict(lambda: deque(maxlen=window))

    def seed(self, model: str, ratio: float) -> None:
        self._ratios[model].append(ratio)

    def record(self, model: str, audio_sec: float, wall_sec: float) -> None:
        """One finished track: its backbone model, seconds of audio, seconds from dispatch to done."""
        if audio_sec > 0 and wall_sec > 0:
            self._ratios[model].append(wall_sec / audio_sec)

    def ratio(self, model: str = "") -> float | None:
        """Mean wall seconds per audio second for the model (any model when it has none yet)."""
        ratios = self._ratios.get(model) or [r for d in self._ratios.values() for r in d]
        return sum(ratios) / len(ratios) if ratios else None

    def job_eta(self, job: Job, positions: Mapping[Key, int], workers: int) -> float | None:
        """Seconds until the job's last track is done, or None without history."""
        ratio = self.ratio(job.request.backbone or "")
        if ratio is None:
            return None
        seconds = job.request.duration * 60 * ratio
        eta = 0.0
        for t in job.tracks:
            if t.status.running:
                eta = max(eta, seconds * (1 - overall_progress(t) / 100))
            elif (job.job_id, t.index) in positions:
                eta = max(eta, math.ceil(positions[(job.job_id, t.index)] / max(1, workers)) * seconds)
        return round(eta, 1)

    def queue_wait(self, queued: int, workers: int) -> float:
        """A Retry-After for a full queue: about how long until it has room again."""
        return min(600.0, 5 + queued / max(1, workers) * (self.ratio() or 1.0) * 30)
