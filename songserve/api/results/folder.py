"""Whether the results folder can be written now, so that a local fault stays local.

When the dispatcher cannot write ``RESULTS_DIR`` (its disk is full, it went read-only, a network
volume dropped), that is nobody's fault but this host's: a finished track must not fail for it, nor
its worker be charged. So the folder has two states:

    writable    copies go ahead
    unwritable  (with the reason) a copy failed writing, or a probe did: the dispatcher is not
                ready (``/ready`` names the folder and the error), starts no new track, and every
                finished track waits, held, until the folder is writable again

It goes back to writable by itself: a supervised loop probes the folder (``step``) every second
while it is unwritable and every ``PROBE_SEC`` otherwise, by writing, syncing and removing a small
file, and, after a copy ran out of space, by finding as much free space as that copy needed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import time
from pathlib import Path

from songserve.errors import SongserveError

log = logging.getLogger(__name__)
PROBE_SEC = 10.0  # between probes while the folder is writable (every second while it is not)
PROBE_BYTES = 4096
PROBE_PREFIX = ".probe-"  # the probe's file in the folder: .probe-<8 hex>.tmp, gone once it passed


class ResultsUnwritable(SongserveError):
    """Writing into the results folder failed: the dispatcher's own fault, not the track's or the worker's."""

    def __init__(self, reason: str, need_bytes: int = 0) -> None:
        super().__init__(reason)
        self.need_bytes = need_bytes  # free space the failed copy needed (0: unknown)


def unwritable(what: str, exc: OSError, need_bytes: int = 0) -> ResultsUnwritable:
    """The one wording of a failed write: what was being written, and the system's reason."""
    return ResultsUnwritable(f"writing {what} failed: {exc.strerror or exc}", need_bytes)


class ResultsFolder:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.problem = ""  # why it cannot be written; empty while it can
        self._need = 0  # bytes of free space a probe must also find (what the failed copy needed)
        self._probed_at = -PROBE_SEC  # monotonic
        self._writable = asyncio.Event()
        self._writable.set()

    @property
    def writable(self) -> bool:
        return not self.problem

    async def wait_writable(self) -> None:
        await self._writable.wait()

    def failed(self, exc: ResultsUnwritable) -> None:
        """A write into the folder failed: unwritable until a probe passes."""
        self._need = max(self._need, exc.need_bytes)
        self._mark(str(exc))

    async def step(self) -> None:
        """One iteration of the probe loop (called every second)."""
        if self.writable and time.monotonic() - self._probed_at < PROBE_SEC:
            return
        self._probed_at = time.monotonic()
        problem = await asyncio.to_thread(self._probe, self._need)
        if problem:
            self._mark(problem)
        elif not self.writable:
            log.warning("results folder %s: writable again; held tracks are copied now", self.root)
            self.problem, self._need = "", 0
            self._writable.set()

    def _mark(self, problem: str) -> None:
        if self.writable:
            log.error(
                "results folder %s cannot be written (%s): finished tracks wait, no new track starts",
                self.root,
                problem,
            )
        self.problem = problem
        self._writable.clear()

    def _probe(self, need: int) -> str:
        """Write, sync and remove a small file, and check free space; returns what failed, or ""."""
        path = self.root / f"{PROBE_PREFIX}{secrets.token_hex(4)}.tmp"
        try:
            with open(path, "wb") as f:
                f.write(b"\0" * PROBE_BYTES)
                f.flush()
                os.fsync(f.fileno())
            path.unlink()
            free = shutil.disk_usage(self.root).free
        except OSError as exc:
            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass  # a read-only folder: nothing was written either
            return f"writing a test file failed: {exc.strerror or exc}"
        if free < need:
            return f"{free / 2**20:.1f} MB free, a waiting copy needs {need / 2**20:.1f} MB"
        return ""
