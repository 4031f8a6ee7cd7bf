"""The job service: the jobs' logic the routes of both dialects and the MCP tools call.

Submit, view, list, cancel, a track's files, its live stream and renders, a job's event stream and
waits. It is given its parts (``compose.py`` makes them); it makes none. The probes and reports read
``readings.py``, uploads are ``uploads.py``, announcements ``announcements.py``, usage ``usage.py``.
It talks to the dispatcher (``dispatch/dispatcher.py``) through a few methods only (``add``, ``cancel``,
``active_job``, ``facts``, ``fleet``, admission), never to a worker or the pool. Active jobs live in
memory and in the store; finished ones only in the store and the results folder. With a shared store
any dispatcher answers for any job: what is not in its memory is read from the store.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from songserve.api.dispatch import retakes
from songserve.api.dispatch.dispatcher import Dispatcher
from songserve.api.jobs.records import Job, Track
from songserve.api.jobs.states import TERMINAL_JOB, JobStatus, TrackStatus, job_status
from songserve.api.jobs.views import job_view
from songserve.api.results import render
from songserve.api.results.artifacts import JOB_ID, ArtifactStore
from songserve.api.service import job_list
from songserve.api.service.adapters import AdapterService
from songserve.api.service.keys import Caller, may_see
from songserve.api.service.live import Listening, LiveStreams, NoAudio
from songserve.api.service.refusals import GoneError, QueueFull, StoreUnavailable
from songserve.api.service.requests import NormalizedRequest, RequestLimits, normalize
from songserve.api.service.uploads import UploadService
from songserve.api.service.usage import OverLimit, check_request, quota
from songserve.api.settings import DispatcherSettings
from songserve.api.store.protocol import DuplicateKey, JobStore, StoreError
from songserve.api.store.quota import OverQuota
from songserve.api.webhooks.targets import Refused, WebhookPolicy
from songserve.audio import codes as codes_file
from songserve.errors import FieldError, NotFoundError, RequestError, UnavailableError
from songserve.process.logs import safe
from songserve.schemas import GenerateAccepted, GenerateRequest, JobList, JobView
from songserve.schemas.body_fields import MAX_NAME_CHARS

log = logging.getLogger(__name__)
MEDIA = {
    "mp3": ("audio/mpeg", "inline"),
    "wav": ("audio/wav", "attachment"),
    "codes": ("application/octet-stream", "attachment"),  # songserve/audio/codes.py's file
}
KEEPALIVE_SEC = 15.0


@dataclass(frozen=True)
class TrackFile:
    path: Path
    media_type: str
    filename: str
    disposition: str


async def load_job(dispatcher: Dispatcher, store: JobStore, job_id: str) -> Job:
    """A job from this dispatcher's memory while active, else from the store; not found otherwise."""
    job = dispatcher.active_job(job_id)
    if job is None and JOB_ID.match(job_id):
        job = await store.load_job(job_id)
    if job is None:
        raise NotFoundError(f"Job {job_id} not found.")
    return job


class JobService:
    """The jobs' logic over the parts it is given (``compose.py`` makes them, once per dispatcher)."""

    def __init__(
        self,
        s: DispatcherSettings,
        store: JobStore,
        artifacts: ArtifactStore,
        dispatcher: Dispatcher,
        uploads: UploadService,
        renders: render.Renders,
        live: LiveStreams,
        adapters: AdapterService,
    ) -> None:
        self.s = s
        self.adapters = adapters  # whose uploaded adapters a key may name
        self.store = store
        self.artifacts = artifacts
        self.dispatcher = dispatcher
        self.uploads = uploads  # a retake may continue from a person's upload
        self.renders = renders
        self.live = live
        self.webhook_policy = WebhookPolicy(s.webhook_allow)

    # ---- submit ---------------------------------------------------------------------------------
    def _normalize(self, req: GenerateRequest, strict: bool) -> NormalizedRequest:
        """The request as it will be served (``requests.normalize``; ``strict``: refuse what it would change)."""
        s, fleet = self.s, self.dispatcher.fleet()
        limits = RequestLimits(
            s.min_duration,
            s.max_duration,
            s.max_tracks,
            s.max_lyrics_chars,
            tuple(fleet.backbone_models),
            tuple(fleet.superres_models),
        )
        norm = normalize(req, limits, strict=strict, cleaning=s.lyrics_cleaning)
        self._check_context(norm.request.duration, fleet.context)
        return norm

    async def _check_adapters(self, req: GenerateRequest, caller: Caller | None) -> None:
        """Refuse before any work a take whose LoRA adapter no worker here can load (``GET /adapters``);
        another key's upload is as unknown to this caller as a name no worker has."""
        if not any(req.take_adapter(i)[0] for i in range(req.num_tracks)):
            return
        offered = await self.adapters.usable(caller)
        for i in range(req.num_tracks):
            name, _ = req.take_adapter(i)
            if name and name not in offered:
                field = f"takes.{i}.adapter" if req.takes is not None else "adapter"
                known = ", ".join(sorted(offered)[:20]) or "none"
                raise FieldError(field, f"no worker here can load adapter {name!r} (GET /adapters; known: {known})")

    def _check_context(self, minutes: float, known: tuple[int, int] | None) -> None:
        """Refuse before any work a song that no worker's context can hold (the workers say their limits)."""
        if known is None:
            return
        context, per_minute = known
        need = math.ceil(per_minute * minutes)
        if need > context:
            raise FieldError(
                "duration",
                f"{minutes:g} minutes need about {need} audio tokens, more than the model's "
                f"context of {context} tokens (max_sequence_length), which holds about "
                f"{context / per_minute:.1f} minutes",
            )

    async def submit(
        self,
        req: GenerateRequest,
        idempotency_key: str | None = None,
        caller: Caller | None = None,
        strict: bool = False,
    ) -> GenerateAccepted:
        """Accept a job (``caller``: the API key that sent it, whose limits apply and whose use it counts; ``strict``:
        refuse what the lenient reading would change, as ``STRICT_REQUESTS`` does)."""
        d = self.dispatcher
        if not d.accepting:
            raise UnavailableError("The dispatcher is shutting down and accepts no new jobs.")
        if req.continue_from is not None and not d.can_continue():
            raise FieldError("continue_from", "no worker here can continue a song (they are all the reference's)")
        parts = req.continue_from.parts if req.continue_from is not None else None
        if parts is not None and not d.can_repaint_parts(len(parts)):
            raise FieldError(
                "continue_from.parts",
                f"no worker here repaints {len(parts)} parts in one take (older workers of ours repaint one part: "
                "send one part per request)",
            )
        retake = None
        if req.continue_from is not None:
            own_job = functools.partial(self.visible, caller=caller)  # another key's take: "not known here"
            own_upload = functools.partial(self.uploads.find, caller=caller)
            retake = await retakes.resolve(
                req, own_job, self.artifacts, own_upload, join_window_sec=self.s.repaint_join_window_sec
            )
        if retake is not None:
            req = retake.request  # what it did not send comes from the take it continues
        norm = self._normalize(req, strict or self.s.strict_requests)
        req, lyrics = norm.request, norm.cleaned_lyrics
        await self._check_adapters(req, caller)
        check_request(caller, req)
        if req.webhook:
            await self._check_webhook(req.webhook)
        if idempotency_key and (existing := await self.store.job_by_key(idempotency_key)):
            return await self._existing(existing, req, norm, caller)
        queued = d.queue_length()
        if queued + req.num_tracks > self.s.max_queue:
            retry = max(1, int(d.queue_wait()))
            raise QueueFull(f"The queue is full ({queued} tracks waiting); try again later.", retry)
        job_id = secrets.token_hex(8)
        base_seed = req.seed if req.seed is not None else 1 + secrets.randbelow(2**31 - 65)  # 0: "the worker's own"
        try:
            job = Job(
                job_id=job_id,
                seq=0,  # the store numbers it
                created_at=time.time(),
                request=req,
                cleaned_lyrics=lyrics,
                priority=req.priority,
                idempotency_key=idempotency_key or None,
                tracks=[Track(job_id, i, base_seed + i) for i in range(req.num_tracks)],
                caller=caller.name if caller is not None else None,
            )
            if retake is not None and retake.kept is not None:  # before the row: a queued retake finds its frames
                blob = codes_file.encode(retake.kept.codes, retake.kept.header)
                await asyncio.to_thread(self.artifacts.write_prefix, job_id, blob)
            # one transaction (with the key's quota): a failed submit leaves no row behind
            await self.store.insert_job(job, quota(caller, d.queue_wait))
        except OverQuota as over:
            self.artifacts.remove_job(job_id)
            raise OverLimit(caller.name if caller else "", over) from None
        except DuplicateKey as dup:  # the same key just now, at this or another dispatcher
            self.artifacts.remove_job(job_id)
            return await self._existing(dup.job_id, req, norm, caller)
        except (StoreError, OSError) as exc:
            self.artifacts.remove_job(job_id)
            log.error("submit: the store or the results folder cannot write: %s", exc)
            raise StoreUnavailable(exc) from None
        log.info(
            "job %s: %d %s, %.2f min, priority %d%s",
            job_id,
            req.num_tracks,
            "track" if req.num_tracks == 1 else "tracks",
            req.duration,
            req.priority,
            f", key {caller.name}" if caller else "",
        )
        if retake is not None and retake.kept is not None:
            log.info("job %s: %s", job_id, retakes.describe(retake.kept))
        if norm.adjusted:  # the values as sent are the client's text: escaped and capped
            log.info("job %s: read as the reference reads it: %s", job_id, safe(norm.adjusted, 500))
        if norm.unknown_count:
            names = ", ".join(safe(n, MAX_NAME_CHARS) for n in norm.ignored[:8])
            more = f" and {norm.unknown_count - 8} more" if norm.unknown_count > 8 else ""
            log.info("job %s: ignored %d unknown fields: %s%s", job_id, norm.unknown_count, names, more)
        idle = d.free_workers()
        await d.add(job)
        position = d.queue_position(job)
        accepted = idle >= req.num_tracks or position == 0
        return GenerateAccepted(
            status="accepted" if accepted else "queued",
            job_id=job_id,
            num_tracks=req.num_tracks,
            queue_position=position,
            adjusted=norm.adjusted,
            ignored=norm.ignored,
            notes=norm.notes,
        )

    async def _check_webhook(self, url: str) -> None:
        """A webhook this dispatcher can sign and may send to (``WEBHOOK_ALLOW``), or a 422 naming it."""
        if not self.s.webhook_secret:
            raise FieldError("webhook", "this dispatcher sends no webhooks (it has no WEBHOOK_SECRET to sign them)")
        try:
            await self.webhook_policy.check(url)
        except Refused as exc:
            raise FieldError("webhook", str(exc)) from None

    async def _existing(
        self, job_id: str, req: GenerateRequest, norm: NormalizedRequest, caller: Caller | None
    ) -> GenerateAccepted:
        """The answer to a repeated Idempotency-Key: the job it made, if the body (and the key) is the same."""
        fields, job = set(GenerateRequest.model_fields), await self.load(job_id)
        if not may_see(caller, job.caller):
            raise FieldError("Idempotency-Key", "was already used by another API key; choose another")
        if job.request.model_dump(include=fields) != req.model_dump(include=fields):
            raise FieldError("Idempotency-Key", "was already used with a different request body")
        view = await self.view(job_id)
        return GenerateAccepted(
            status="queued" if view.queue_position else "accepted",
            job_id=job_id,
            num_tracks=len(view.tracks),
            queue_position=view.queue_position,
            adjusted=norm.adjusted,
            ignored=norm.ignored,
            notes=norm.notes,
        )

    # ---- view and cancel ------------------------------------------------------------------------
    async def load(self, job_id: str) -> Job:
        """The job, whoever sent it (``visible`` checks the caller)."""
        return await load_job(self.dispatcher, self.store, job_id)

    async def ids(self) -> set[str]:
        """The ids of every job in the store (finished ones until retention removes them)."""
        return await self.store.job_ids()

    async def visible(self, job_id: str, caller: Caller | None) -> Job:
        """The job, if ``caller``'s key may see it (``keys.py``: ``sees``); another key's is not found either."""
        job = await self.load(job_id)
        if not may_see(caller, job.caller):
            raise NotFoundError(f"Job {job_id} not found.")
        return job

    async def view(self, job_id: str) -> JobView:
        return self.view_of(await self.load(job_id))

    def view_of(self, job: Job) -> JobView:
        """A job's view as this dispatcher sees it now (queue positions, estimates)."""
        facts = self.dispatcher.facts(job)
        return job_view(job, facts.positions, facts.eta, facts.waiting)

    async def jobs(self, caller: Caller | None, limit: int, cursor: str | None) -> JobList:
        """``GET /jobs``: the jobs ``caller`` may see, newest first (``service/job_list.py``)."""
        return await job_list.list_jobs(self.store, self.load, self.dispatcher.facts, caller, limit, cursor)

    async def cancel(self, job_id: str) -> JobView:
        job = await self.load(job_id)
        if job.terminal or job_status((t.status for t in job.tracks), job.cancelled) in TERMINAL_JOB:
            return await self.view(job_id)  # finished: a no-op
        await self.dispatcher.cancel(job)
        return await self.view(job_id)

    async def track_file(self, job_id: str, idx: int, kind: str) -> TrackFile:
        if kind not in MEDIA:
            raise NotFoundError(f"No such file kind {kind!r}; use mp3, wav, codes or render.")
        job = await self.load(job_id)
        if not 0 <= idx < len(job.tracks):
            raise RequestError(f"Track index {idx} is out of range for a job of {len(job.tracks)} tracks.")
        track = job.tracks[idx]
        if track.status != TrackStatus.done and self.store.shared and self.dispatcher.active_job(job_id) is job:
            # Memory follows a shared store by its events: another dispatcher may have just finished it.
            track = (await self.store.load_job(job_id) or job).tracks[idx]
        if track.status != TrackStatus.done:
            raise NotFoundError(f"Track {idx} of job {job_id} is not done.")
        expected = (track.metadata.get("file_bytes") or {}).get(kind)
        if kind == "codes" and expected is None:
            raise NotFoundError(
                f"Track {idx} of job {job_id} kept no codes (its worker writes none, or it was made "
                "before codes were kept)."
            )
        size = self.artifacts.sizes(job_id, idx).get(kind)
        if not size or (expected is not None and size != expected):
            what = "is missing" if size is None else "is empty" if not size else "does not have its recorded size"
            log.error("job %s track %d: the %s file %s", job_id, idx, kind, what)
            raise GoneError(f"The {kind} file of track {idx} of job {job_id} {what}; generate the song again.")
        media, disposition = MEDIA[kind]
        return TrackFile(self.artifacts.path(job_id, idx, kind), media, f"{job_id}_track{idx}.{kind}", disposition)

    async def stream(
        self, job_id: str, idx: int, fmt: str, listen: bool = True
    ) -> TrackFile | tuple[str, Listening | None]:
        """A track's audio as it is made (``live.py``: a listener's place, or None without ``listen``, for
        HEAD); a finished track's final file; 409 for one that ended without audio, 503 past the caps."""
        media = self.live.media_type(fmt)
        view = await self.view(job_id)
        if not 0 <= idx < len(view.tracks):
            raise RequestError(f"Track index {idx} is out of range for a job of {len(view.tracks)} tracks.")
        track = view.tracks[idx]
        if track.status == TrackStatus.done:
            return await self.track_file(job_id, idx, fmt)
        if TrackStatus(track.status).terminal:
            raise NoAudio(
                f"Track {idx} of job {job_id} is {track.status}: it has no audio"
                f"{' (' + track.error + ')' if track.error else ''}."
            )
        return media, self.live.listen(job_id, idx, fmt) if listen else None

    async def render(
        self, job_id: str, idx: int, fmt: str, loudness: float | None, start: float | None, end: float | None
    ) -> tuple[TrackFile, dict[str, str]]:
        """A finished take in another format, loudness or range (``render.py``), from the cache or made now."""
        await self.track_file(job_id, idx, "wav")  # done, present, of its recorded size
        job = await self.load(job_id)
        spec = render.parse(fmt, loudness, start, end, job.tracks[idx].duration_sec)
        r = job.request
        style = (r.prompt if r.prompt_mode == "natural" else r.tags).strip()
        title = f"{style[:80]} (take {idx + 1})" if style else f"songserve {job_id} take {idx + 1}"
        got = await self.renders.get(job_id, idx, spec, title, job.cleaned_lyrics)  # cached, shared or bounded
        name = spec.filename(job_id, idx, job.tracks[idx].duration_sec)
        return TrackFile(got.path, got.media_type, name, "attachment"), got.headers()

    async def events(self, job_id: str, disconnected: Callable[[], Awaitable[bool]]) -> AsyncIterator[str]:
        """Server-sent events: the job view on every change, until it is terminal."""
        changes = self.dispatcher.changes
        last = None
        while not await disconnected():
            before = changes.version
            view = await self.view(job_id)
            body = view.model_dump_json()
            if body != last:
                last = body
                yield f"event: job\ndata: {body}\n\n"
            if view_ended(view):
                return
            if await changes.wait(before, timeout=KEEPALIVE_SEC) == before:
                yield ": keep-alive\n\n"

    async def watch(self, job_id: str, seconds: float) -> AsyncIterator[JobView]:
        """The job's view now, then after each change (a second at most: a job ended elsewhere), until it has
        ended or ``seconds`` have passed: what ``Prefer: wait`` and MCP's waits follow."""
        changes, deadline = self.dispatcher.changes, time.monotonic() + seconds
        while True:
            before = changes.version
            yield (view := await self.view(job_id))
            if view_ended(view) or (left := deadline - time.monotonic()) <= 0:
                return
            await changes.wait(before, timeout=min(left, 1.0))

    async def wait_for_end(self, job_id: str, seconds: float) -> JobView | None:
        """``Prefer: wait``: the job's view once it has ended, or None after ``seconds``.

        Between changes it reads the job's records (``job_ended``) and makes the view once, at the end:
        every change wakes every waiter, and a thousand views a change held the event loop in bursts."""
        changes, deadline = self.dispatcher.changes, time.monotonic() + seconds
        while True:
            before = changes.version
            job = await self.load(job_id)
            if job_ended(job):
                return self.view_of(job)
            if (left := deadline - time.monotonic()) <= 0:
                return None
            await changes.wait(before, timeout=min(left, 1.0))


def view_ended(view: JobView) -> bool:
    """The job and every track of it have ended."""
    return JobStatus(view.status) in TERMINAL_JOB and all(TrackStatus(t.status).terminal for t in view.tracks)


def job_ended(job: Job) -> bool:
    """``view_ended`` of the job's view, from its records alone: a cancelled job's running track shows as
    cancelled (``jobs/views.py``), so it has ended for a waiter too."""
    shown = (TrackStatus.cancelled if job.cancelled and t.status.running else t.status for t in job.tracks)
    return job_status((t.status for t in job.tracks), job.cancelled) in TERMINAL_JOB and all(s.terminal for s in shown)
