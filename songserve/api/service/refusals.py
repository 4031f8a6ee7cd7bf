"""The job service's refusals: what a submit, a file or an announcement cannot get, and why (one status each).

Kept beside ``job_service.py``, which raises them; ``http_errors.py`` turns each into the one error body.
"""

from __future__ import annotations

from songserve.errors import SongserveError


class QueueFull(SongserveError):
    """More tracks than ``MAX_QUEUE`` would wait (HTTP 429, with a Retry-After from the queue's pace)."""

    http_status = 429

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.headers = {"Retry-After": str(retry_after)}


class StoreUnavailable(SongserveError):
    """The job store cannot write (disk full, I/O error): nothing was accepted; try again later."""

    def __init__(self, exc: Exception) -> None:
        reason = exc.args[0] if exc.args else exc
        full = "full" in str(reason).lower()
        super().__init__(
            "The job store's disk is full; nothing was queued, try again later."
            if full
            else f"The job store cannot write ({reason}); nothing was queued, try again later."
        )
        self.http_status = 507 if full else 503
        self.headers = {"Retry-After": "30"}


class AnnounceRefused(SongserveError):
    """A worker's announcement without the right token (401), or announcing is off here (403)."""

    def __init__(self, message: str, http_status: int) -> None:
        super().__init__(message)
        self.http_status = http_status


class GoneError(SongserveError):
    """A done track whose file was removed or damaged on disk (HTTP 410)."""

    http_status = 410
