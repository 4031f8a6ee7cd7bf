"""``GET /v1/stats``: jobs by ACE-Step's five words, the queue, the mean run time.

ACE-Step counts the jobs of its in-memory store (kept 24 h); the same here are the jobs of our
store (kept ``RESULT_TTL_SEC``), read through the ``JobService``; the queue through the readings. A finished job never changes, so
``JobTally`` reads each from the store once and remembers its word and run time; only unfinished
jobs are looked at again (from memory while this dispatcher has them). ``queued`` counts jobs
waiting for any worker, ``running`` jobs with a take on a worker; ``succeeded`` includes partly
failed jobs (ACE-Step's status 1), ``failed`` cancelled ones (its status 2). ``queue_size`` and
``queue_maxsize`` are in takes, the unit ``MAX_QUEUE`` counts; ``avg_job_seconds`` is the mean run
time (first take started → last ended) of the 50 jobs that finished last, 0 before any has.
"""

from __future__ import annotations

from dataclasses import dataclass

from songserve.api.jobs.records import Job
from songserve.api.jobs.states import TERMINAL_JOB, JobStatus, job_status
from songserve.api.service.job_service import JobService
from songserve.api.service.readings import Readings
from songserve.errors import NotFoundError

WINDOW = 50  # ACE-Step's ACESTEP_AVG_WINDOW default
WORDS = {
    JobStatus.queued: "queued",
    JobStatus.pending: "running",
    JobStatus.generating: "running",
    JobStatus.completed: "succeeded",
    JobStatus.partial: "succeeded",
    JobStatus.failed: "failed",
    JobStatus.cancelled: "failed",
}


@dataclass(frozen=True)
class Finished:
    word: str
    ended: float
    run_sec: float | None


class JobTally:
    def __init__(self) -> None:
        self._finished: dict[str, Finished] = {}

    async def stats(self, svc: JobService, readings: Readings) -> dict[str, object]:
        ids = await svc.ids()
        for gone in set(self._finished) - ids:
            del self._finished[gone]
        counts = dict.fromkeys(("queued", "running", "succeeded", "failed"), 0)
        for job_id in ids:
            done = self._finished.get(job_id)
            if done is not None:
                counts[done.word] += 1
                continue
            try:
                job = await svc.load(job_id)
            except NotFoundError:  # removed between the two reads
                continue
            counts[self._look(job)] += 1
        recent = sorted((f for f in self._finished.values() if f.run_sec is not None), key=lambda f: f.ended)
        runs = [f.run_sec for f in recent[-WINDOW:] if f.run_sec is not None]
        return {
            "jobs": {"total": sum(counts.values()), **counts},
            "queue_size": readings.queue_length(),
            "queue_maxsize": readings.max_queue,
            "avg_job_seconds": round(sum(runs) / len(runs), 3) if runs else 0.0,
        }

    def _look(self, job: Job) -> str:
        """The job's word; a finished job is remembered with its run time."""
        status = job_status((t.status for t in job.tracks), job.cancelled)
        word = WORDS[status]
        if status in TERMINAL_JOB and all(t.status.terminal for t in job.tracks):
            start, end = job.start_time(), job.end_time()
            run = end - start if start is not None and end is not None else None
            self._finished[job.job_id] = Finished(word, end or job.created_at, run)
        return word
