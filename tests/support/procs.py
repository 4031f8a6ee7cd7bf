"""Finding a test's processes by a marker in their environment, which every child inherits.

A process that outlives its parent is reparented and keeps no link to the test; its environment
still says where it came from.
"""

from __future__ import annotations

from pathlib import Path

MARK = "SONGSERVE_TEST_MARK"


def marked(mark: str) -> dict[int, str]:
    """Every live process whose environment carries ``MARK=mark``: pid → command line."""
    needle = f"{MARK}={mark}".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if state != "Z":  # a zombie has exited; only its parent's wait is left
            found[int(entry.name)] = cmd
    return found
