"""Artifacts on disk: each finished track's WAV, MP3, code grid and JSON, copied from its worker and checked.

Files are streamed (never held in memory) into ``<results>/<job_id>/track_<i>.<ext>``: every file of
a track first under a temporary name, within one deadline for the whole copy, a floor on its rate
(a copy that crawls is cut after ``FLOOR_WINDOW_SEC`` instead of waiting out the deadline: without the
floor, a worker that drips a byte a second holds each track for the whole 45 s) and a size cap per
file, then checked against what the worker said it wrote (``results/result_check.py``), and only then all
renamed into place, so a track is never completed with a short or damaged file, and results survive
a worker's restart and its cleanup. What goes wrong is told apart: ``WorkerFault`` is the worker's
(a file it cannot serve, short, damaged, oversize or late), ``ResultsUnwritable`` ours (the folder
cannot be written; ``results/folder.py`` holds whether it can now). Beside the tracks in the job's
folder, under the same retention: a retake's kept frames (``prefix.codes``, cut from the original
at submit, so the retake does not depend on the original's folder) and cached renders
(``track_<i>.render-<key>.<ext>``). Uploads (a person's own audio) live apart, in
``<results>/uploads/<upload_id>/``: the file as sent (``source.<ext>``, the extension from its format,
never from its name) and, once encoded, its code grid (``codes.codes``). Uploaded LoRA adapters too,
in ``<results>/adapters/<name>/`` under PEFT's file names (what the dispatcher sends a worker that
lacks one; kept until their key deletes them, never by retention). Retention removes finished
jobs and uploads past their TTL and, oldest first, while the folder is over its size cap, and asks
``orphans`` / ``upload_orphans`` for folders no row owns (a store moved aside or restored from an
older backup).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
import secrets
import shutil
import time
from collections import deque
from collections.abc import Collection
from pathlib import Path
from typing import IO, TYPE_CHECKING

from songserve.api.results.folder import ResultsFolder, ResultsUnwritable, unwritable
from songserve.api.results.result_check import Copied, check_copy
from songserve.api.workers.outcomes import WorkerFault
from songserve.api.workers.to_worker import result_files
from songserve.schemas.common import ADAPTER_CONFIG, ADAPTER_PATTERN, ADAPTER_WEIGHTS

if TYPE_CHECKING:
    from songserve.api.workers.client import WorkerClient
    from songserve.schemas import WorkerGenerateResult

log = logging.getLogger(__name__)
KINDS = ("wav", "mp3", "json", "codes")
JOB_ID = re.compile(r"^[a-f0-9]{8,64}$")
RENDER_KEY = re.compile(r"^[a-f0-9]{16}$")
RENDER_EXTS = ("flac", "opus", "mp3", "wav", "json")  # a render, and the JSON beside it
UPLOADS = "uploads"  # the folder of uploads inside the results folder (not a job id: retention's job sweep skips it)
ADAPTERS = "adapters"  # the folder of uploaded LoRA adapters (not a job id either)
ADAPTER_NAME = re.compile(ADAPTER_PATTERN)
ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)  # PEFT's names, as a worker reads them
UPLOAD_FILE = re.compile(r"^(source\.[a-z0-9]{1,8}|codes\.codes)$")
FLOOR_WINDOW_SEC = 5  # a copy's rate is judged over its last this many seconds


class ArtifactStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.folder = ResultsFolder(root)

    def path(self, job_id: str, index: int, kind: str) -> Path:
        """The only way a file path is formed: from a checked job id, an index and a known kind."""
        if not JOB_ID.match(job_id) or kind not in KINDS or index < 0:
            raise ValueError("invalid artifact address")
        return self.root / job_id / f"track_{index}.{kind}"

    def adapter_folder(self, name: str) -> Path:
        """An uploaded adapter's folder (its two files under PEFT's names), from a checked name."""
        if not ADAPTER_NAME.match(name):
            raise ValueError("invalid adapter address")
        return self.root / ADAPTERS / name

    def stage_adapter(self, config: IO[bytes], weights: IO[bytes]) -> tuple[Path, int, str]:
        """An adapter's two files copied into a new staged folder beside the kept ones: (the folder,
        their bytes, the weights' SHA-256). ``keep_adapter`` names it; ``discard`` removes it."""
        (self.root / ADAPTERS).mkdir(parents=True, exist_ok=True)
        staged = self.root / ADAPTERS / f".staged-{secrets.token_hex(6)}"
        staged.mkdir()
        size, digest = 0, hashlib.sha256()
        try:
            for data, filename in zip((config, weights), ADAPTER_FILES, strict=True):
                data.seek(0)
                with (staged / filename).open("wb") as out:
                    while chunk := data.read(1 << 20):
                        out.write(chunk)
                        size += len(chunk)
                        if filename == ADAPTER_FILES[1]:
                            digest.update(chunk)
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise
        return staged, size, digest.hexdigest()

    def keep_adapter(self, staged: Path, name: str) -> Path:
        """The staged folder as adapter ``name``'s (one left by an earlier delete that did not finish is replaced)."""
        folder = self.adapter_folder(name)
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(staged, folder)
        return folder

    def remove_adapter(self, name: str) -> None:
        if ADAPTER_NAME.match(name):
            shutil.rmtree(self.root / ADAPTERS / name, ignore_errors=True)

    @staticmethod
    def discard(staged: Path) -> None:
        shutil.rmtree(staged, ignore_errors=True)

    def prefix_path(self, job_id: str) -> Path:
        """A retake's kept frames (``songserve/audio/codes.py``'s file), written when it is submitted."""
        if not JOB_ID.match(job_id):
            raise ValueError("invalid artifact address")
        return self.root / job_id / "prefix.codes"

    def write_prefix(self, job_id: str, data: bytes) -> None:
        """Keep a retake's kept frames in its job's folder (a temporary name, then a rename)."""
        _write_atomic(self.prefix_path(job_id), data)

    def upload_path(self, upload_id: str, name: str) -> Path:
        """A file of an upload: ``source.<ext>`` or ``codes.codes``, from a checked id and name."""
        if not JOB_ID.match(upload_id) or not UPLOAD_FILE.match(name):
            raise ValueError("invalid upload address")
        return self.root / UPLOADS / upload_id / name

    def write_upload(self, upload_id: str, name: str, data: bytes | IO[bytes]) -> None:
        """One file of an upload (its bytes, or an open file copied from its start in blocks), written
        under a temporary name then renamed."""
        _write_atomic(self.upload_path(upload_id, name), data)

    def remove_upload(self, upload_id: str) -> None:
        if JOB_ID.match(upload_id):
            shutil.rmtree(self.root / UPLOADS / upload_id, ignore_errors=True)

    def upload_bytes(self, upload_id: str) -> int:
        d = self.root / UPLOADS / upload_id
        return sum(p.stat().st_size for p in d.glob("*") if p.is_file()) if JOB_ID.match(upload_id) else 0

    def upload_orphans(self, known_ids: Collection[str], min_age_sec: float = 300.0) -> list[str]:
        """Upload folders no known upload owns (as ``orphans`` for jobs)."""
        folder = self.root / UPLOADS
        return self.orphans(known_ids, min_age_sec, folder) if folder.is_dir() else []

    def render_path(self, job_id: str, index: int, key: str, ext: str) -> Path:
        """A cached render of a track: ``key`` is the hash of its parameters."""
        if not JOB_ID.match(job_id) or index < 0 or not RENDER_KEY.match(key) or ext not in RENDER_EXTS:
            raise ValueError("invalid artifact address")
        return self.root / job_id / f"track_{index}.render-{key}.{ext}"

    def renders(self, job_id: str, index: int) -> list[Path]:
        """The cached renders of a track, oldest first."""
        if not JOB_ID.match(job_id) or index < 0:
            raise ValueError("invalid artifact address")
        found = [p for p in (self.root / job_id).glob(f"track_{index}.render-*") if p.is_file()]
        return sorted(found, key=lambda p: p.stat().st_mtime)

    def has(self, job_id: str, index: int, kind: str) -> bool:
        p = self.path(job_id, index, kind)
        return p.is_file() and not p.is_symlink()

    async def collect(
        self,
        worker: WorkerClient,
        res: WorkerGenerateResult,
        job_id: str,
        index: int,
        max_bytes: int,
        deadline: float,
        floor: float = 0.0,
    ) -> int:
        """``fetch``, waiting while the results folder cannot be written: the track is held (its worker
        keeps the files) and the copy starts again once the folder's probe passes. Raises only
        ``WorkerFault``."""
        while True:
            if not self.folder.writable:
                log.warning(
                    "track %s/%d: held until the results folder can be written (%s)", job_id, index, self.folder.problem
                )
            await self.folder.wait_writable()
            try:
                return await self.fetch(worker, res, job_id, index, max_bytes, deadline, floor)
            except ResultsUnwritable as exc:
                log.warning("track %s/%d: its files could not be stored (%s)", job_id, index, exc)

    async def fetch(
        self,
        worker: WorkerClient,
        res: WorkerGenerateResult,
        job_id: str,
        index: int,
        max_bytes: int,
        deadline: float,
        floor: float = 0.0,
    ) -> int:
        """Copy, check and put in place the files of one finished track; returns the bytes copied.

        ``deadline``: seconds for the whole copy (every file, concurrently); ``max_bytes``: per file;
        ``floor``: bytes a second the copy must move over each ``FLOOR_WINDOW_SEC`` (0: no floor).
        Raises ``WorkerFault`` or ``ResultsUnwritable`` (after marking the folder unwritable); on
        either, nothing of the copy stays behind.
        """
        names = result_files(res)
        said = {kind: res.files.get(name) for kind, name in names.items()}
        need = sum(f.bytes for f in said.values() if f is not None)
        finals = {kind: self.path(job_id, index, kind) for kind in names}
        tmps = {kind: p.with_name(f".{p.name}.{secrets.token_hex(3)}.tmp") for kind, p in finals.items()}
        try:
            try:
                self.path(job_id, index, "wav").parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise unwritable(f"the folder {job_id}", exc, need) from None
            copies = await self._copy_all(worker, names, finals, tmps, max_bytes, (deadline, floor), need)
            for kind, name in names.items():
                check_copy(name, kind, copies[kind], said[kind], res.duration_sec)
            for kind in names:
                try:
                    os.replace(tmps[kind], finals[kind])
                except OSError as exc:
                    raise unwritable(finals[kind].name, exc, need) from None
        except ResultsUnwritable as exc:
            self.folder.failed(exc)
            raise
        finally:
            for tmp in tmps.values():
                with contextlib.suppress(OSError):
                    tmp.unlink(missing_ok=True)
        return sum(c.size for c in copies.values())

    async def _copy_all(
        self,
        worker: WorkerClient,
        names: dict[str, str],
        finals: dict[str, Path],
        tmps: dict[str, Path],
        max_bytes: int,
        limits: tuple[float, float],
        need: int,
    ) -> dict[str, Copied]:
        """Every file of the track into its temporary name, concurrently, within ``limits``: the deadline
        (seconds) and the floor (bytes a second over each ``FLOOR_WINDOW_SEC``; 0: none)."""
        deadline, floor = limits
        moved = [0]  # bytes of every file so far
        try:
            async with asyncio.timeout(deadline), asyncio.TaskGroup() as group:
                tasks = {
                    kind: group.create_task(self._copy(worker, name, finals[kind], tmps[kind], max_bytes, need, moved))
                    for kind, name in names.items()
                }
                if floor > 0:
                    group.create_task(_keep_floor(worker, list(tasks.values()), moved, floor))
        except TimeoutError:
            raise WorkerFault(
                f"Worker {worker.url} did not deliver the track's files within {deadline:.0f}s."
            ) from None
        except BaseExceptionGroup as group:
            # Ours first: a folder that cannot be written says nothing of the worker.
            first = group.subgroup(ResultsUnwritable) or group.subgroup(WorkerFault) or group
            raise first.exceptions[0] from None
        return {kind: task.result() for kind, task in tasks.items()}

    @staticmethod
    async def _copy(
        worker: WorkerClient, name: str, final: Path, tmp: Path, max_bytes: int, need: int, moved: list[int]
    ) -> Copied:
        """One file into ``tmp`` (``final`` names it in errors), hashed as it arrives (counted in ``moved``)."""
        digest, size = hashlib.sha256(), 0
        try:
            with open(tmp, "wb") as f:
                async with contextlib.aclosing(worker.file_chunks(name, max_bytes)) as chunks:
                    async for chunk in chunks:
                        digest.update(chunk)
                        size += len(chunk)
                        moved[0] += len(chunk)
                        f.write(chunk)
        except OSError as exc:  # the network's errors arrive as WorkerFault: an OSError here is our disk's
            raise unwritable(final.name, exc, max(need, size)) from None
        return Copied(tmp, size, digest.hexdigest())

    def remove_job(self, job_id: str) -> None:
        if JOB_ID.match(job_id):
            shutil.rmtree(self.root / job_id, ignore_errors=True)

    def orphans(self, known_ids: Collection[str], min_age_sec: float = 300.0, folder: Path | None = None) -> list[str]:
        """Job folders (sorted) that no known job owns: candidates for retention to report or remove.

        Only folders named like a job id count (anything else in the folder is not ours to touch).
        A folder changed within ``min_age_sec`` is skipped: its job row may be newer than the
        caller's ``known_ids``.
        """
        known = set(known_ids)
        cutoff = time.time() - min_age_sec
        out = []
        for entry in os.scandir(folder or self.root):
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
        """Every job's and every upload's files."""
        files = [*self.root.glob("*/*"), *self.root.glob(f"{UPLOADS}/*/*")]
        return sum(p.stat().st_size for p in files if p.is_file())


async def _keep_floor(worker: WorkerClient, copies: list[asyncio.Task[Copied]], moved: list[int], floor: float) -> None:
    """Ends with the copies; raises ``WorkerFault`` (which stops them) when they moved fewer than
    ``floor`` × ``FLOOR_WINDOW_SEC`` bytes over the last ``FLOOR_WINDOW_SEC`` seconds."""
    marks = deque([0], maxlen=FLOOR_WINDOW_SEC + 1)  # ``moved`` at each second of the copy
    while True:
        finished, _ = await asyncio.wait(copies, timeout=1.0)  # back at once when all are done
        if len(finished) == len(copies):
            return
        marks.append(moved[0])
        if len(marks) == marks.maxlen and marks[-1] - marks[0] < floor * FLOOR_WINDOW_SEC:
            raise WorkerFault(
                f"Worker {worker.url} sent {marks[-1] - marks[0]} bytes of the track's files in {FLOOR_WINDOW_SEC} s, "
                f"under the floor of {floor / 1000:.0f} KB/s (DOWNLOAD_FLOOR_KB_PER_SEC)."
            )


def _write_atomic(path: Path, data: bytes | IO[bytes]) -> None:
    """``data`` as ``path``: written under a temporary name in its folder, then renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(3)}.tmp")
    try:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            data.seek(0)
            with tmp.open("wb") as out:
                shutil.copyfileobj(data, out, 1 << 20)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
