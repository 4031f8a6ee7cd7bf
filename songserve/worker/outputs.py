"""The worker's output folder: its disk as ``/health`` reports it, what each result file holds, and
the removal of its own files.

A finished take's answer carries each file's size and SHA-256 (``file_facts``), read back from the
disk ``/download`` serves it from, so the dispatcher can tell a short or damaged copy from the file.

The worker removes what export wrote there and nothing else: per task once the dispatcher has
copied it (``DELETE /files/{task_id}``; the names come from the task's result or its JSON), and by
age as a safety net (``sweep_outputs``, every ``OUTPUT_TTL_SEC``). Only plain names with export's
suffixes are removed, never a link or a path.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

from songserve.schemas import ResultFile

log = logging.getLogger(__name__)
OUTPUT_SUFFIXES = (
    ".wav",
    ".mp3",
    ".json",
    ".codes",
    ".pcm",
    ".tmp",
)  # export and live audio write these; nothing else is removed
OUTPUT_NAME = re.compile(r"^\.?[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}$")


def _existing(path: Path) -> Path:
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def disk_report(out_dir: Path, min_free_mb: float) -> dict[str, Any]:
    """``/health``'s view of the output disk: free MB, whether it is below ``MIN_FREE_DISK_MB``, file count."""
    try:
        free_mb: float | None = round(shutil.disk_usage(_existing(out_dir)).free / 2**20, 1)
    except OSError:
        free_mb = None
    files = 0
    try:
        with os.scandir(out_dir) as it:
            files = sum(1 for e in it if e.is_file(follow_symlinks=False))
    except OSError:
        pass
    return {"disk_free_mb": free_mb, "disk_low": free_mb is None or free_mb < min_free_mb, "output_files": files}


def file_facts(out_dir: Path, names: list[str]) -> dict[str, ResultFile]:
    """Size and SHA-256 of each named output file (blocking: read in 1 MiB blocks, off the event loop).

    A file that cannot be read is left out with a warning: its download will say what is wrong.
    """
    facts: dict[str, ResultFile] = {}
    for name in names:
        digest, size = hashlib.sha256(), 0
        try:
            with open(out_dir / name, "rb") as f:
                while block := f.read(1 << 20):
                    digest.update(block)
                    size += len(block)
        except OSError as exc:
            log.warning("output %s: cannot be read back for its checksum: %s", name, exc.strerror or exc)
            continue
        facts[name] = ResultFile(bytes=size, sha256=digest.hexdigest())
    return facts


def remove_output(out_dir: Path, name: str) -> bool:
    """Remove one output file by plain name (no paths, no links, only export's suffixes)."""
    if not OUTPUT_NAME.match(name) or ".." in name or not name.endswith(OUTPUT_SUFFIXES):
        return False
    path = out_dir / name
    if path.is_symlink() or not path.is_file():
        return False
    path.unlink(missing_ok=True)
    return True


def names_from_metadata(out_dir: Path, task_id: str) -> list[str]:
    """The files of ``task_id`` as recorded in its JSON (for tasks this process does not remember)."""
    found: list[str] = []
    try:
        entries = [e for e in os.scandir(out_dir) if e.name.endswith(".json") and not e.name.startswith(".")]
    except OSError:
        return found
    for entry in entries:
        try:
            meta = json.loads(Path(entry.path).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(meta, dict) and meta.get("task_id") == task_id:
            files = meta.get("files") or {}
            found += [str(files[k]) for k in ("wav", "mp3", "codes") if k in files] + [entry.name]
    return found


def sweep_outputs(out_dir: Path, ttl_sec: float, now: float | None = None) -> int:
    """Remove export's files in ``out_dir`` last changed more than ``ttl_sec`` ago; returns how many."""
    cutoff = (time.time() if now is None else now) - ttl_sec
    removed = 0
    try:
        entries = list(os.scandir(out_dir))
    except OSError:
        return 0
    for entry in entries:
        try:
            if entry.stat(follow_symlinks=False).st_mtime < cutoff and remove_output(out_dir, entry.name):
                removed += 1
        except OSError as exc:
            log.warning("output sweep: could not remove %s: %s", entry.name, exc.strerror or exc)
    if removed:
        log.info("output sweep: removed %d file(s) older than %.0fs from %s", removed, ttl_sec, out_dir)
    return removed
