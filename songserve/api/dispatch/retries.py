"""Retries: which failed attempts cost a track one of its tries, and when it has none left (pure rules).

A failure anywhere in an attempt ends as ``RetryTrack`` (``attempts.py`` turns it into the track's
next state: queued again, or an error). Not every failure costs a try of ``MAX_ATTEMPTS``:
- an attempt its worker never began (it was busy), or whose worker left the pool, gives the try back;
- an environment failure (the worker's disk, memory or writes; or a worker's own fault: an answer out
  of contract, files not what it said) costs none while the fleet has tries to spare, each worker's
  share (``environment_share``); past that they count again, so a fleet that all misbehaves ends the
  track;
- the rest cost one, and a track whose tries ran out ends in error with the last reason (``given_up``).

The rules are arithmetic only, apart from the attempts' own state, so they are read (and tested) here.
"""

from __future__ import annotations


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
