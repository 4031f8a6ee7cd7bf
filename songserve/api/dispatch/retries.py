"""Retries: which failed attempts cost a track one of its tries, and when it has none left (pure rules).

A failure anywhere in an attempt ends as ``RetryTrack`` (``attempts.py`` turns it into the track's
next state: queued again, or an error). Not every failure costs a try of ``MAX_ATTEMPTS``:
- an attempt its worker never began (it was busy), or whose worker left the pool, gives the try back;
- an environment failure (the worker's disk, memory or writes; or a worker's own fault: an answer out
  of contract, files not what it said) costs none while the fleet has tries to spare, each worker's
  share (``environment_share``); past that they count again, so a fleet that all misbehaves ends the
  track;
- the rest cost one, and a track whose tries ran out ends in error with the last reason (``given_up``).

The rules are arithmetic only, apart from the attempts' own state, so they are read (and tested) here,
and so is the one decision they serve: how an attempt ended → the track's next state (``next_state``).
The attempt (``attempts.py``) gathers the facts (the answer or the failure, the job's cancel as the
store has it), asks, and writes what it is told.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from songserve.api.workers.outcomes import Outcome, OutcomeKind


class RetryTrack(Exception):
    """The track should run again; ``count`` is False when the attempt never started, or when the
    worker failed it for an environment reason (``environment``: disk, memory, writes)."""

    def __init__(self, reason: str, count: bool = True, environment: bool = False) -> None:
        super().__init__(reason)
        self.count = count and not environment
        self.environment = environment


def environment_share(max_attempts: int, workers: int) -> int:
    """Environment failures a track may have before they cost tries again: every worker's share."""
    return max_attempts * max(1, workers)


def tries_used(attempts: int, count: bool) -> int:
    """A track's tries once an attempt ends: the one it began is given back when the attempt does not count."""
    return attempts if count else max(0, attempts - 1)


def given_up(attempts: int, max_attempts: int, reason: str) -> str | None:
    """The error of a track whose tries ran out (None: it runs again)."""
    return f"Track failed after {attempts} attempts: {reason}." if attempts >= max_attempts else None


class Next(StrEnum):
    """What becomes of a track once an attempt of it ended."""

    collect = "collect"  # its files are copied and checked, then it is done
    cancelled = "cancelled"  # its job was cancelled (a finished take's files are not wanted)
    error = "error"  # it ends with ``NextState.reason``
    queued = "queued"  # it runs again (``reason``: why)


@dataclass(frozen=True)
class Tries:
    """A track's tries as its attempt ends, and the bounds they are counted against."""

    attempts: int  # tries begun, the one ending included
    env_failures: int  # attempts ended by environment failures so far (they cost no try)
    max_attempts: int
    workers: int  # the pool's size: each worker's share of environment failures


@dataclass(frozen=True)
class NextState:
    next: Next
    attempts: int  # the track's tries from now on (a try that does not count is given back)
    env_failures: int
    reason: str = ""  # the error's sentence, or why it runs again
    retried: bool = False  # a failure ended the attempt (counted in the retries gauge), not an answer


def next_state(end: Outcome | RetryTrack, tries: Tries, job_cancelled: bool, worker_id: int) -> NextState:
    """How an attempt on worker ``worker_id`` ended (its answer, or a failure on the way) → the track's
    next state. ``job_cancelled``: the job's cancel as the store has it (a finished take only needs
    what this dispatcher knows)."""
    if isinstance(end, Outcome):
        kind = end.kind
        if kind is OutcomeKind.done and end.result is not None:
            return NextState(Next.cancelled if job_cancelled else Next.collect, tries.attempts, tries.env_failures)
        if kind is OutcomeKind.cancelled:
            if job_cancelled:
                return NextState(Next.cancelled, tries.attempts, tries.env_failures)
            end = RetryTrack(f"worker {worker_id} stopped the task")
        elif kind is OutcomeKind.busy:
            end = RetryTrack(f"worker {worker_id} was busy", count=False)
        elif end.environment and tries.env_failures + 1 < environment_share(tries.max_attempts, tries.workers):
            end = RetryTrack(f"worker {worker_id}: {end.error}", environment=True)
        else:  # the model's clear sentence, or the fleet's share of environment failures spent
            return NextState(Next.error, tries.attempts, tries.env_failures, end.error)
    env_failures, count = tries.env_failures, end.count
    if end.environment:
        env_failures += 1
        # Past every worker's share of tries they count again: a fleet that all misbehaves ends the track.
        count = env_failures >= environment_share(tries.max_attempts, tries.workers)
    attempts = tries_used(tries.attempts, count)
    if job_cancelled:
        return NextState(Next.cancelled, attempts, env_failures, retried=True)
    if (msg := given_up(attempts, tries.max_attempts, str(end))) is not None:
        return NextState(Next.error, attempts, env_failures, msg, retried=True)
    return NextState(Next.queued, attempts, env_failures, str(end), retried=True)
