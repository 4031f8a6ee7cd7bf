"""Why a task failed, as a kind and a sentence: whose fault it is, so the dispatcher knows where to retry.

A full disk, a write error or running out of memory is the worker's environment, not the track:
another worker may succeed (``ErrorKind.environment``). A failure inside the model on this input is
``model``; a request that cannot be served as asked is ``request``. The sentence names the output
folder by its last name only (the full path is in the worker's log), never a bare exception name.
"""

from __future__ import annotations

import errno
from pathlib import Path

from songserve.errors import RequestError, TaskError, WorkerStateError
from songserve.schemas import ErrorKind


class ClassifiedTaskError(TaskError):
    """A task failure with its kind (environment, model or request), for the error body and ``TaskView``."""

    def __init__(self, message: str, kind: ErrorKind) -> None:
        super().__init__(message)
        self.kind = kind


def error_kind_of(exc: BaseException) -> ErrorKind | None:
    """The kind of a task failure raised by ``generate``; None for refusals that are not failures."""
    if isinstance(exc, ClassifiedTaskError):
        return exc.kind
    if isinstance(exc, RequestError):
        return ErrorKind.request
    if isinstance(exc, WorkerStateError):
        return ErrorKind.environment
    if isinstance(exc, TaskError):
        return ErrorKind.model
    return None


def _is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def _shown(path: Path) -> str:
    """A folder as a client may see it: its last name only (the full path is in the worker's log)."""
    return f"…/{path.name}" if path.name else str(path)


def classify_failure(exc: BaseException, out_dir: Path, out_of_memory: bool = False) -> tuple[ErrorKind, str]:
    """(kind, sentence) for an unexpected task failure; never a bare exception class name for the disk.

    ``out_of_memory``: the device said ``exc`` is its framework's out-of-memory error (torch's).
    """
    if out_of_memory or _is_out_of_memory(exc):
        return ErrorKind.environment, "The worker ran out of memory."
    if isinstance(exc, OSError):
        where = Path(exc.filename) if exc.filename else out_dir
        inside = where == out_dir or out_dir in where.parents
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return ErrorKind.environment, f"The worker's output disk is full ({_shown(out_dir if inside else where)})."
        reason = exc.strerror or type(exc).__name__
        if inside:
            return (
                ErrorKind.environment,
                f"The worker could not write its output files in {_shown(out_dir)} ({reason}).",
            )
        return ErrorKind.environment, f"The worker hit a system error on {_shown(where)} ({reason})."
    return ErrorKind.model, f"The task failed inside the model ({type(exc).__name__})."
