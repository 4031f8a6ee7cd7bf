"""Encodings: a queued upload to a free worker, its codes into the results folder, its row to ready or failed.

Short work, served before generation: each dispatch pass offers its free workers (leased here, ours,
with an encoder: ``WorkerHandle.can_encode``) to the oldest queued uploads first (``start``), and
only what is left to tracks. Each upload is claimed in the store under the worker's lease
(``store.uploads.claim``: one dispatcher encodes it), and one asyncio task runs the attempt (``_run``):
1. the file as it was uploaded, read from the results folder a block at a time as it is sent to the worker (``POST /encode``,
   with the lease header tracks carry), within ``DEADLINE_BASE_SEC`` + the audio's length;
2. the answer checked (the codec's 64 levels of codes in range; the worker's frame count is the one kept);
3. the grid written as ``codes.codes`` (``songserve/audio/codes.py``, the format of a take's codes) and the
   row made ``ready``.
The worker is busy meanwhile (``WorkerHandle.encoding``) and free again when it answers.

What ends an attempt without an answer (the worker busy, unreachable, answering out of contract,
past the deadline; the codes not writable) sends the upload back to the queue, up to ``MAX_ATTEMPTS``
tries (a busy answer is not counted), then ``failed`` with the last reason; a worker that refuses
the file itself (a 4xx) fails it at once. ``reconcile``, after each membership step, re-queues what
a dead dispatcher, or this one before a restart, left ``encoding``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import BinaryIO

import numpy as np

from songserve.api.dispatch import retakes
from songserve.api.dispatch.attempts import Attempts
from songserve.api.dispatch.pool import WorkerHandle
from songserve.api.jobs.records import Job
from songserve.api.results.artifacts import ArtifactStore
from songserve.api.settings import DispatcherSettings
from songserve.api.store.members import Fence
from songserve.api.store.protocol import JobStore, StoreError, background_context
from songserve.api.store.uploads import UploadRecord
from songserve.api.workers.outcomes import EncodeRefused, WorkerBusy, WorkerFault, WorkerUnreachable
from songserve.audio import codes
from songserve.schemas import CODEBOOK_SIZE, UploadStatus, WorkerEncodeResult

log = logging.getLogger(__name__)
LEVELS = 64  # the codec's levels: what every continuation keeps


class Encodings:
    """This dispatcher's encodings: which run (``running``), and how each goes."""

    def __init__(
        self,
        s: DispatcherSettings,
        me: str,
        store: JobStore,
        artifacts: ArtifactStore,
        fences: Attempts,
        kick: Callable[[], None],
    ) -> None:
        self.s = s
        self.me = me
        self.store = store
        self.artifacts = artifacts
        self.fences = fences  # the lease of a worker, and the header that tells the worker so
        self.kick = kick  # a worker is free again, or an upload became ready: the dispatch loop looks again
        self.running: dict[str, asyncio.Task[None]] = {}  # upload id → its attempt
        # A claim and its entry in ``running`` against ``reconcile``'s look at ``running`` and its requeue:
        # without it a claim landing between the two was requeued as an encoding no attempt was behind.
        self._claims = asyncio.Lock()
        self.counts: dict[str, int] = {}  # uploads by status in the store, as ``reconcile`` last read them

    async def start(self, free: list[WorkerHandle]) -> list[WorkerHandle]:
        """Give the oldest queued uploads the free workers that encode; returns the workers left for tracks."""
        able = [w for w in free if w.can_encode]
        if not able:
            return free
        try:
            queued = await self.store.uploads.queued(len(able))
        except StoreError as exc:  # the tracks' turn is not lost to it: their own claims meet the store anyway
            log.warning("uploads: the queue could not be read (%s)", exc)
            return free
        for u in queued:
            able = [w for w in able if w.available]  # the claims below await: re-read what may have moved
            if not able:
                break
            w = able[0]
            fence = self.fences.fence_of(w)
            if u.upload_id in self.running or fence is None:
                continue
            async with self._claims:
                try:
                    if not await self.store.uploads.claim(u.upload_id, fence):
                        continue  # another dispatcher's now, or the lease is not held here any more
                except StoreError as exc:
                    log.warning("upload %s: could not be claimed (%s)", u.upload_id, exc)
                    break
                self._begin(u, w, fence)
            able.remove(w)
            free = [x for x in free if x is not w]
        return free

    def _begin(self, u: UploadRecord, w: WorkerHandle, fence: Fence) -> None:
        """A claimed upload's attempt on ``w``, in ``running`` before the claim's lock is let go."""
        w.start_encoding(u.upload_id)
        log.info(
            "upload %s: attempt %d on worker %d (%.1f s of audio)",
            u.upload_id,
            u.attempts + 1,
            w.worker_id,
            u.duration_sec,
        )
        task = asyncio.create_task(self._run(u, w, fence), name=f"encode-{u.upload_id}", context=background_context())
        self.running[u.upload_id] = task
        task.add_done_callback(functools.partial(self._ended, u.upload_id))

    def _ended(self, upload_id: str, _: asyncio.Task[None]) -> None:
        self.running.pop(upload_id, None)

    async def _run(self, u: UploadRecord, w: WorkerHandle, fence: Fence) -> None:
        answered = False
        source: BinaryIO | None = None
        try:
            try:
                path = self.artifacts.upload_path(u.upload_id, f"source.{u.ext}")
                source = await asyncio.to_thread(path.open, "rb")
            except OSError:
                await self._finish(u, error="its file is gone from the results folder")
                return
            timeout = self.s.deadline_base_sec + u.duration_sec
            try:
                res = await w.client.encode(
                    _blocks(source), f"upload-{u.upload_id}", timeout, self.fences.lease_header(fence)
                )
                answered = True
                grid = self._check(res)
            except WorkerBusy as exc:
                answered = True
                await self._retry(u, f"worker {w.worker_id} could not take it ({exc})", count=False)
                return
            except EncodeRefused as exc:
                answered = True
                await self._finish(u, error=str(exc))
                return
            except WorkerUnreachable as exc:  # WorkerFault too: another worker may do better
                await self._retry(u, str(exc))
                return
            head = {
                "upload_id": u.upload_id,
                "frame_rate": res.frame_rate,
                "hop": res.hop,
                "sample_rate": res.sample_rate,
                "source": res.source,
                "models": {},
            }
            try:
                blob = codes.encode(grid, head)
                await asyncio.to_thread(self.artifacts.write_upload, u.upload_id, "codes.codes", blob)
            except OSError as exc:
                await self._retry(u, f"its codes could not be written ({exc})", count=False)
                return
            await self._finish(u, frames=int(grid.shape[1]))
            log.info(
                "upload %s: ready, %d frames (worker %d, %s)", u.upload_id, grid.shape[1], w.worker_id, res.timings
            )
        except StoreError as exc:  # reconcile re-queues it (its owner, this dispatcher, runs no attempt then)
            log.warning("upload %s: its state could not be stored (%s)", u.upload_id, exc)
        finally:
            if source is not None:
                source.close()
            w.encoded(u.upload_id, answered)
            self.kick()

    @staticmethod
    def _check(res: WorkerEncodeResult) -> np.ndarray:
        """The grid of an answer, (64, frames) int16, or ``WorkerFault`` when it is not a codec's grid."""
        g = res.grid
        raw = np.frombuffer(g.raw(), dtype="<i2").reshape(g.levels, g.frames)
        if g.levels != LEVELS or raw.size == 0 or int(raw.min()) < 0 or int(raw.max()) >= CODEBOOK_SIZE:
            raise WorkerFault(
                f"Worker answered {g.levels} × {g.frames} codes, not {LEVELS} levels in [0, {CODEBOOK_SIZE})."
            )
        return raw.astype(np.int16)

    async def _finish(self, u: UploadRecord, frames: int | None = None, error: str | None = None) -> None:
        """The upload ends: ready with ``frames``, or failed with ``error``; nothing if it is no longer ours."""
        status = UploadStatus.failed if error is not None else UploadStatus.ready
        if error is not None:
            log.warning("upload %s: failed: %s", u.upload_id, error)
        done = UploadRecord(
            **{
                **u.__dict__,
                "status": status,
                "frames": frames if frames is not None else u.frames,
                "error": error,
                "finished_at": time.time(),
            }
        )
        if not await self.store.uploads.finish(done, self.me) and await self.store.uploads.load(u.upload_id) is None:
            await asyncio.to_thread(self.artifacts.remove_upload, u.upload_id)  # deleted while it encoded

    async def _retry(self, u: UploadRecord, reason: str, count: bool = True) -> None:
        """Back to the queue, or failed once ``MAX_ATTEMPTS`` counted tries have ended so."""
        if count and u.attempts + 1 >= self.s.max_attempts:
            await self._finish(u, error=f"it could not be encoded in {self.s.max_attempts} tries; the last: {reason}")
            return
        log.warning("upload %s: back to the queue: %s", u.upload_id, reason)
        await self.store.uploads.requeue(u.upload_id, self.me, reason, count)

    async def frames_for(self, job: Job) -> str | None:
        """Before a job's tracks start: ``""`` when it needs nothing of an upload or its kept frames are
        cut, None while its upload is still queued or encoding (its tracks wait), else why they never
        will be (its tracks fail saying so)."""
        cf = job.request.continue_from
        if cf is None or cf.upload_id is None:
            return ""
        ready = await retakes.upload_frames_ready(
            job, self.artifacts, self.store.uploads.load, self.s.repaint_join_window_sec
        )
        return None if ready is False else "" if ready is True else ready

    async def reconcile(self, alive: set[str]) -> None:
        """Uploads left ``encoding`` by a dead dispatcher, or by this one before a restart, go back to the queue."""
        async with self._claims:  # no claim lands between the look at ``running`` and the requeue
            n = await self.store.uploads.requeue_stale(alive, self.me, set(self.running))
        if n:
            log.info("uploads: %d left encoding with no attempt behind them, queued again", n)
            self.kick()
        self.counts = await self.store.uploads.counts()

    def can_encode(self, workers: list[WorkerHandle]) -> bool:
        """Some worker could encode an upload: one of ours says so, or has not said yet (none known: they may come)."""
        return not workers or any(w.can_encode or (w.config is None and not w.client.reference) for w in workers)

    async def stop(self) -> None:
        tasks = list(self.running.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _blocks(f: BinaryIO, size: int = 1 << 20) -> AsyncIterator[bytes]:
    """An upload's file sent as it is read, a block at a time off the event loop (never whole in memory)."""
    while block := await asyncio.to_thread(f.read, size):
        yield block
