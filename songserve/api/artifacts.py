"""Artifacts on disk: each finished track's WAV, MP3 and JSON, copied from its worker.

Files are streamed (never held in memory) into ``<results>/<job_id>/track_<i>.<ext>`` under a
temporary name, then renamed, so results survive a worker's restart and its cleanup. Retention
removes finished jobs past their TTL and, oldest first, while the folder is over its size cap, and
asks ``orphans`` for folders no job row owns (a store moved aside or restored from an older backup).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import time
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from songserve.api.worker_client import WorkerClient

KINDS = ("wav", "mp3", "json")
JOB_ID = re.compile(r"^[a-f0-9]{8,64}$")


class ArtifactStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def path(self, job_id: str, index: int, kind: str) -> Path:
        """The only way a file path is formed: from a checked job id, an index and a known kind."""
        if not JOB_ID.match(job_id) or kind not in KINDS or index < 0:
            raise ValueError("invalid artifact address")
        return self.root / job_id / f"track_{index}.{kind}"

    def has(self, job_id: str, index: int, kind: str) -> bool:
        p = self.path(job_id, index, kind)
        return p.is_file() and not p.is_symlink()

    async def fetch(self, worker: WorkerClient, names: dict[str, str], job_id: str, index: int) -> int:
        """Stream the worker's files for one track into place (concurrently); returns bytes written."""
        self.path(job_id, index, "wav").parent.mkdir(parents=True, exist_ok=True)
        sizes = await asyncio.gather(
            *(worker.download(name, self.path(job_id, index, kind)) for kind, name in names.items())
        )
        return sum(sizes)

    def remove_job(self, job_id: str) -> None:
        if JOB_ID.match(job_id):
            shutil.rmtree(self.root / job_id, ignore_errors=True)

    def orphans(self, known_ids: Collection[str], min_age_sec: float = 300.0) -> list[str]:
        """Job folders (sorted) that no known job owns: candidates for retention to report or remove.

        Only folders named like a job id count (anything else in the folder is not ours to touch).
        A folder changed within ``min_age_sec`` is skipped: its job row may be newer than the
        caller's ``known_ids``.
        """
        known = set(known_ids)
        cutoff = time.time() - min_age_sec
        out = []
        for entry in os.scandir(self.root):
            if entry.name in known or not JOB_ID.match(entry.name):
                continue
            if entry.is_dir(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_mtime <= cutoff:
                out.append(entry.name)
        return sorted(out)

    def job_bytes(self, job_id: str) -> int:
        d = self.root / job_id
        return sum(p.stat().st_size for p in d.glob("*") if p.is_file()) if d.is_dir() else 0

    def sizes(self, job_id: str, index: int) -> dict[str, int]:
        """Bytes of each file a track has (recorded when it is done, checked when it is served)."""
        return {kind: self.path(job_id, index, kind).stat().st_size for kind in KINDS if self.has(job_id, index, kind)}

    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.root.glob("*/*") if p.is_file())
