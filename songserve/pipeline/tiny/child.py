"""Build the tiny set in a child process that the worker waits for, and that takes its helpers with it.

Why: megatron-core's checkpoint writer starts a ``multiprocessing`` Manager (a spawned server
process, ~270 MB) and a resource tracker the first time a set is saved, and stops them only when
the saving process exits normally. A worker that built the tiny set in its own process and was
then killed with ``kill -9`` left both running, with nobody to stop them. Here the build runs as
``python -m songserve.pipeline.tiny`` in a process group of its own:

- it exits when the set is written, and its normal exit stops the Manager; the worker waits for
  it without reaping it, kills whatever is still in its group (nothing, normally), then reaps it;
- if the worker dies first (``kill -9`` during the build), the kernel sends the child SIGTERM
  (``prctl(PR_SET_PDEATHSIG)``), and the child kills its whole group, itself included.

A killed build leaves only ``.tiny.building``, which the next build replaces.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import FrameType

from songserve.errors import ConfigError
from songserve.pipeline.config import PACKAGE_ROOT

log = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def build_in_child(out: Path) -> Path:
    """Build the default tiny set at ``out`` in a child process (unless a current one is there)."""
    from songserve.pipeline.tiny.manifest import is_built

    if is_built(out):
        return out
    cmd = [sys.executable, "-m", "songserve.pipeline.tiny", "--out", str(out), "--die-with-parent", str(os.getpid())]
    proc = subprocess.Popen(cmd, cwd=PACKAGE_ROOT, stdout=subprocess.DEVNULL, process_group=0)
    try:
        # Exited but not reaped: its pid, which is its group's id, cannot be taken by another process yet.
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait()
    if code != 0 or not is_built(out):
        raise ConfigError(
            f"Building the tiny checkpoint set in {out} failed (exit status {code}); see the lines above."
        )
    return out


def die_with_parent(parent: int) -> None:
    """In the child: when ``parent`` dies, kill this process's group (this process and its helpers)."""

    def kill_group(signum: int, frame: FrameType | None) -> None:
        os.killpg(0, signal.SIGKILL)

    signal.signal(signal.SIGTERM, kill_group)
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d): this build outlives its parent", ctypes.get_errno())
    if os.getppid() != parent:  # the parent died before the death signal was armed
        kill_group(signal.SIGTERM, None)
