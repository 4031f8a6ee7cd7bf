"""What both engines' schema migrations share: a step, the refusal of a newer schema, the log line.

Why here: the engines migrate differently (SQLite one step per write transaction under
``PRAGMA user_version``; PostgreSQL every step in one transaction under an advisory lock), but they
walk the same numbered versions, refuse a store written by a newer build with the same words, and
say what they did in one line. Neither engine imports the other: both import this.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass


@dataclass(frozen=True)
class Migration:
    """One schema step: its number, what it is for (logged), and its statements, run in order."""

    version: int
    what: str
    statements: tuple[str, ...] = ()


class NewerSchemaError(Exception):
    """The store was written by a newer build; opening it here could lose what that build stored."""

    def __init__(self, found: int, known: int) -> None:
        super().__init__(f"schema version {found}, newer than this build's {known}")
        self.found, self.known = found, known

    def refusal(self, where: str, instead: str) -> str:
        """The one line that refuses the store at ``where``; ``instead``: the setting that points elsewhere."""
        return (
            f"The job store {where} has schema version {self.found}, newer than this build's {self.known}: "
            f"run the newer songserve on it, or point {instead}."
        )


def log_migrated(log: logging.Logger, first: int, applied: list[int], what: list[str]) -> None:
    """One line, whatever the number of steps: a fresh store is made, not "migrated" seven times."""
    if not applied:
        return
    if first == 0:
        log.info("job store: created (schema version %d)", applied[-1])
    else:
        log.info("job store: schema migrated from version %d to %d (%s)", first, applied[-1], "; ".join(what))
