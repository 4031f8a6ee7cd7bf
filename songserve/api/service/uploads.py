"""Uploads: a person's own audio, checked, stored and queued for encoding; what the ``/uploads`` routes call.

``receive`` reads ``POST /uploads``'s multipart body as it arrives into a spooled temporary file
(``songserve/http/forms.py``), never whole into memory. ``create`` decodes the whole file before anything is
stored (``songserve/audio/reading.py``'s ``check_audio``, block by block, keeping no samples: not audio,
empty, cut short, less than a frame, longer than the longest song the model can continue, more to
decode than that length allows: a 422 naming the field ``file``; over ``UPLOAD_MAX_MB``: 413), then
copies it into the results folder (``uploads/<id>/source.<ext>``) and its row (``queued``) into the
job store, so any dispatcher of a shared store answers for it, and asks the dispatcher to look at
once: encodings go before tracks (``encodings.py``). ``view``, ``codes`` and ``delete`` read the
store, not this process's memory. Retention removes uploads as it removes jobs (``retention.py``).

At most ``UPLOAD_CONCURRENCY`` uploads are decoded and copied at once, on their own threads (so
renders, live audio and file relays keep theirs); up to ``UPLOAD_QUEUE`` more wait in line (their
bodies on disk meanwhile), and one past those is a 503 with ``Retry-After`` before its body is read.
"""

from __future__ import annotations

import asyncio
import io
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import IO, TypeVar

from starlette.requests import Request

from songserve.api.dispatch.dispatcher import Dispatcher
from songserve.api.results.artifacts import JOB_ID, ArtifactStore
from songserve.api.service.keys import Caller, may_see
from songserve.api.service.refusals import StoreUnavailable
from songserve.api.settings import DispatcherSettings
from songserve.api.store.protocol import JobStore, StoreError
from songserve.api.store.uploads import UploadRecord
from songserve.audio.reading import HOP, AudioError, AudioFacts, check_audio
from songserve.errors import FieldError, NotFoundError, SongserveError, UnavailableError
from songserve.http.forms import FormLimits, background_thread, read_form
from songserve.process.logs import safe
from songserve.schemas import UploadStatus, UploadView

log = logging.getLogger(__name__)
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
MULTIPART_SLACK = 64 * 1024  # bytes of a multipart body beyond its file: boundaries, headers, small fields


def upload_limit(s: DispatcherSettings) -> tuple[int, str]:
    """The body limit of a route that takes an audio file (the file's cap and a multipart envelope), and its 413."""
    said = f"The file is larger than UPLOAD_MAX_MB ({s.upload_max_mb:g} MB); nothing was stored."
    return int(s.upload_max_mb * 2**20) + MULTIPART_SLACK, said


class UploadTooLarge(SongserveError):
    http_status = 413


class UploadsBusy(UnavailableError):
    """As many uploads as may be in flight are: a 503 with ``Retry-After``, before the body is read."""

    def __init__(self, inside: int, s: DispatcherSettings) -> None:
        super().__init__(
            f"{inside} uploads are being checked or waiting (UPLOAD_CONCURRENCY {s.upload_concurrency} "
            f"+ UPLOAD_QUEUE {s.upload_queue}); nothing was stored, try again shortly."
        )
        self.headers = {"Retry-After": str(RETRY_AFTER_SEC)}


RETRY_AFTER_SEC = 5
_HOLDS_TICKET: ContextVar[bool] = ContextVar("upload_ticket", default=False)  # this request has its place
T = TypeVar("T")


class UploadGate:
    """``running`` uploads decoded and copied at once on their own threads, ``waiting`` more in line."""

    def __init__(self, s: DispatcherSettings) -> None:
        self.s = s
        self.limit = s.upload_concurrency + s.upload_queue
        self.inside = 0  # uploads between their ticket and their answer
        self._slots = asyncio.Semaphore(s.upload_concurrency)
        self.executor = ThreadPoolExecutor(
            s.upload_concurrency, thread_name_prefix="upload", initializer=background_thread
        )

    @asynccontextmanager
    async def ticket(self) -> AsyncIterator[None]:
        """One upload's place in line; ``UploadsBusy`` when there is none (nothing read yet). A request
        holds one place: taken again within it (ACE-Step's route, then ``create``), it is the same."""
        if _HOLDS_TICKET.get():
            yield
            return
        if self.inside >= self.limit:
            log.warning(
                "upload refused: %d uploads in flight, the most UPLOAD_CONCURRENCY + UPLOAD_QUEUE allow (503)",
                self.inside,
            )
            raise UploadsBusy(self.inside, self.s)
        self.inside += 1
        held = _HOLDS_TICKET.set(True)
        try:
            yield
        finally:
            _HOLDS_TICKET.reset(held)
            self.inside -= 1

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """One of the ``running`` places, for the steps that ``run`` on the uploads' threads."""
        async with self._slots:
            yield

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


class UploadService:
    def __init__(
        self, s: DispatcherSettings, store: JobStore, artifacts: ArtifactStore, dispatcher: Dispatcher
    ) -> None:
        self.s = s
        self.store = store
        self.artifacts = artifacts
        self.dispatcher = dispatcher
        self.max_bytes = int(s.upload_max_mb * 2**20)
        self.gate = UploadGate(s)

    def max_seconds(self) -> float:
        """The longest song the model can continue: ``MAX_DURATION``, and the workers' context where they say it."""
        limit = self.s.max_duration * 60
        known = self.dispatcher.fleet().context
        if known is not None:
            context, per_minute = known
            limit = min(limit, context / per_minute * 60)
        return limit

    async def receive(self, request: Request, caller: Caller | None = None) -> UploadView:
        """``POST /uploads``: a place in line first, then the multipart body (its ``file`` spooled), then ``create``."""
        async with self.gate.ticket():
            if not request.headers.get("content-type", "").lower().startswith("multipart/form-data"):
                raise FieldError("file", "is required: send the audio as a multipart/form-data field named file")
            self._check_encoders()  # before a byte is read
            body, too_large = upload_limit(self.s)
            limits = FormLimits(body, self.s.max_body_bytes, self.max_bytes, too_large)
            form = await read_form(request.stream(), request.headers["content-type"], limits)  # FormError: 400/413
            try:
                part = form.files.get("file")
                if part is None:
                    raise FieldError("file", "is required: send the audio as a multipart/form-data field named file")
                return await self._create(part.file, part.filename, caller)
            finally:
                form.close()  # its spooled files: already unlinked, closing frees them

    async def create(self, data: bytes | IO[bytes], filename: str, caller: Caller | None = None) -> UploadView:
        """Check, store and queue one audio file (``caller``: the key that sent it, the only one that
        sees it unless another sees all); nothing is stored when it is refused."""
        async with self.gate.ticket():
            return await self._create(io.BytesIO(data) if isinstance(data, bytes) else data, filename, caller)

    async def _create(self, file: IO[bytes], filename: str, caller: Caller | None) -> UploadView:
        size = file.seek(0, io.SEEK_END)
        if size > self.max_bytes:
            raise UploadTooLarge(
                f"The file is larger than UPLOAD_MAX_MB ({self.s.upload_max_mb:g} MB); nothing was stored."
            )
        self._check_encoders()
        run = self.gate.run
        async with self.gate.slot():
            try:
                facts: AudioFacts = await run(check_audio, file, self.max_seconds())
            except AudioError as exc:
                raise FieldError("file", f"the file {exc}") from None
            u = UploadRecord(
                upload_id=secrets.token_hex(8),
                created_at=time.time(),
                status=UploadStatus.queued,
                filename=CONTROL.sub("", filename)[:200],
                ext=facts.extension,
                bytes=size,
                duration_sec=facts.duration_sec,
                frames=facts.samples // HOP,
                source=facts.describe(),
                caller=caller.name if caller is not None else None,
            )
            try:
                await run(self.artifacts.write_upload, u.upload_id, f"source.{u.ext}", file)
                await self.store.uploads.insert(u)
            except (StoreError, OSError) as exc:
                self.artifacts.remove_upload(u.upload_id)
                log.error("upload: the store or the results folder cannot write: %s", exc)
                raise StoreUnavailable(exc) from None
        log.info(
            "upload %s: %s, %.2f s (%s, %d Hz, %d channels), %d bytes, queued",
            u.upload_id,
            safe(u.filename, 80),
            u.duration_sec,
            facts.format,
            facts.sample_rate,
            facts.channels,
            u.bytes,
        )
        self.dispatcher.kick()
        return view(u)

    def _check_encoders(self) -> None:
        if not self.dispatcher.encodings.can_encode(self.dispatcher.pool.workers):
            raise UnavailableError(
                "No worker here can encode audio (their checkpoint sets hold no encoder); nothing was stored."
            )

    async def find(self, upload_id: str, caller: Caller | None = None) -> UploadRecord | None:
        """The upload, or None when there is none ``caller``'s key may see (``keys.py``: ``sees``)."""
        u = await self.store.uploads.load(upload_id) if JOB_ID.match(upload_id) else None
        return u if u is not None and may_see(caller, u.caller) else None

    async def load(self, upload_id: str, caller: Caller | None = None) -> UploadRecord:
        if (u := await self.find(upload_id, caller)) is None:
            raise NotFoundError(f"Upload {upload_id[:64]} not found (uploads are kept for RESULT_TTL_SEC).")
        return u

    async def view(self, upload_id: str, caller: Caller | None = None) -> UploadView:
        return view(await self.load(upload_id, caller))

    async def codes(self, upload_id: str, caller: Caller | None = None) -> Path:
        """Its ``.codes`` file, once ready."""
        u = await self.load(upload_id, caller)
        if u.status is not UploadStatus.ready:
            raise NotFoundError(f"Upload {upload_id} is {u.status.value}, not ready: it has no codes yet.")
        path = self.artifacts.upload_path(upload_id, "codes.codes")
        if not path.is_file():
            raise NotFoundError(f"The codes of upload {upload_id} are gone; upload the file again.")
        return path

    async def delete(self, upload_id: str, caller: Caller | None = None) -> UploadView:
        """Forget it: its row, then its files (an encoding still running finds it gone and keeps nothing)."""
        u = await self.load(upload_id, caller)
        await self.store.uploads.delete(upload_id)
        await asyncio.to_thread(self.artifacts.remove_upload, upload_id)
        log.info("upload %s: deleted (%s)", upload_id, u.status.value)
        return view(u)


def view(u: UploadRecord) -> UploadView:
    return UploadView(
        upload_id=u.upload_id,
        status=u.status,
        duration_sec=round(u.duration_sec, 4),
        frames=u.frames,
        error=u.error if u.status is UploadStatus.failed else None,
        filename=u.filename,
        source=u.source,
        created_at=u.created_at,
        finished_at=u.finished_at,
        attempts=u.attempts,
        codes=f"/uploads/{u.upload_id}/codes" if u.status is UploadStatus.ready else None,
    )
