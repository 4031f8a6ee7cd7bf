"""A track's audio while it is made: ``GET /job/{id}/track/{i}/stream`` on any dispatcher.

The relay follows the track wherever it is, as the store tells it (so any dispatcher of a shared
store serves any track): queued, it waits; running on one of our workers, it relays that worker's
live audio (``GET /tasks/{task}/stream``, 16-bit PCM); done, it serves the rest from the final
WAV. The listener hears one stream from the start of the track to its end:

- ``sent`` counts the PCM bytes already relayed; every source is read from there on, so a retry on
  another worker, a worker reconnected to, or the final file each continue at the same sample;
- a worker's stream ends when its take ends or its live audio can go no further; the relay then
  looks at the track again: done → the rest of the final audio, then the end of the stream;
  failed or cancelled → the stream is cut (the transfer ends incomplete: a player reports an
  error, ``curl`` exits with 18), after a log line saying why; the track's view says it too;
- ``wav``: a RIFF header whose sizes say "unknown" (0xFFFFFFFF), then PCM as it comes; ``mp3``
  (the default: a browser's ``<audio>`` plays it as it arrives): encoded here with LAME. The
  stream's MP3 has no gapless header (it would have to be written first), so a decoder adds LAME's
  priming samples at its start.

Listeners never cost a generation: every listener of a track on this dispatcher shares
one relay (``live_feed.TrackFeed``: one connection to the worker, one MP3 encoder, the bytes spooled
once, ``service/live_spool.py``), the relays have an HTTP client of their own (``worker_client.WorkerHttp``:
they cannot take the connections of the health polls and the tasks), and listeners are capped per
track and in all (``LIVE_LISTENERS_PER_TRACK``, ``LIVE_LISTENERS_MAX``: a 503 with ``Retry-After``
beyond). A listener that reads slowly or goes away holds only its socket and its place in the
spool; the worker's model thread never waits for anyone.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import soundfile as sf
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from songserve.api.dispatch.tracks import ChangeFeed
from songserve.api.jobs.records import Job, Key
from songserve.api.jobs.states import TrackStatus
from songserve.api.service.live_feed import CHANNELS, SAMPLE_RATE, TrackFeed
from songserve.api.service.live_spool import LIVE_IO, StreamCut
from songserve.api.workers.client import WorkerClient
from songserve.api.workers.outcomes import WorkerFault, WorkerUnreachable
from songserve.errors import FieldError, RequestError, UnavailableError

__all__ = ["LiveResponse", "LiveStreams", "Listening", "NoAudio", "StreamCut", "TooManyListeners", "wav_header"]

log = logging.getLogger(__name__)
FRAME_BYTES = 2 * CHANNELS  # one 16-bit sample per channel
FORMATS = {"mp3": "audio/mpeg", "wav": "audio/wav"}
WAIT_SEC = 0.5  # a relay with nothing to relay looks at its track again this often (or on a change here)
RETRY_SEC = 0.5  # after a worker's stream broke
FINAL_BLOCK = SAMPLE_RATE  # sample frames per read of the final WAV
FULL_RETRY_SEC = 5  # the Retry-After of a listener refused for the caps


class NoAudio(RequestError):
    """The track ended without audio (failed or cancelled): 409, saying how it ended."""

    http_status = 409


class TooManyListeners(UnavailableError):
    """A listener past ``LIVE_LISTENERS_PER_TRACK`` or ``LIVE_LISTENERS_MAX``: 503 with ``Retry-After``."""

    headers = {"Retry-After": str(FULL_RETRY_SEC)}


def wav_header(rate: int = SAMPLE_RATE, channels: int = CHANNELS) -> bytes:
    """A 16-bit PCM WAV header for a stream of unknown length (RIFF and data sizes 0xFFFFFFFF)."""
    unknown = 0xFFFFFFFF
    fmt = struct.pack("<HHIIHH", 1, channels, rate, rate * channels * 2, channels * 2, 16)
    return (
        b"RIFF"
        + struct.pack("<I", unknown)
        + b"WAVEfmt "
        + struct.pack("<I", 16)
        + fmt
        + b"data"
        + struct.pack("<I", unknown)
    )


def _final_block(path: Path, frame: int) -> bytes:
    """``FINAL_BLOCK`` frames of the final WAV from ``frame`` as 16-bit PCM (b"" past its end). Opened and
    closed within the call: the file object belongs to one thread, however the caller is cancelled."""
    with sf.SoundFile(path) as f:
        if frame >= f.frames:
            return b""
        f.seek(frame)
        return bytes(f.read(FINAL_BLOCK, dtype="int16", always_2d=True).tobytes())


async def final_pcm(path: Path, from_frame: int) -> AsyncIterator[bytes]:
    """The final WAV's PCM from sample frame ``from_frame`` on, a block at a time (read off the loop)."""
    loop, frame = asyncio.get_running_loop(), from_frame
    while block := await loop.run_in_executor(LIVE_IO, _final_block, path, frame):
        frame += len(block) // FRAME_BYTES
        yield block


class Listening:
    """One listener's place: its bytes (``chunks``) and its leaving (``leave``, once, whichever comes first:
    the end of its stream or the end of its response)."""

    def __init__(self, streams: LiveStreams, key: Key, feed: TrackFeed, fmt: str) -> None:
        self.streams, self.key, self.feed, self.fmt = streams, key, feed, fmt
        self._left = False

    async def chunks(self) -> AsyncIterator[bytes]:
        """The header (WAV), then the track's audio from its start to its end; ``StreamCut`` if it failed."""
        try:
            if self.fmt == "wav":
                yield wav_header()
            spool, offset = self.feed.spool(self.fmt), 0
            while data := await spool.read(offset):
                offset += len(data)
                yield data
        finally:
            self.leave()

    def leave(self) -> None:
        if not self._left:
            self._left = True
            self.streams.left(self.key, self.feed)


class LiveStreams:
    """The relays behind ``GET /job/{id}/track/{i}/stream`` (see the module docstring)."""

    def __init__(
        self,
        load_job: Callable[[str], Awaitable[Job]],
        live_client: Callable[[int], WorkerClient | None],
        final_wav: Callable[[str, int], Path],
        changes: ChangeFeed,
        folder: Path,
        per_track: int,
        most: int,
    ) -> None:
        self.load_job = load_job
        self.live_client = live_client
        self.final_wav = final_wav
        self.changes = changes
        self.folder = folder  # the spools' files (unlinked temporary files)
        self.per_track, self.most = per_track, most
        self.feeds: dict[Key, TrackFeed] = {}
        self.listeners = 0
        self._closing: set[asyncio.Task[None]] = set()

    @staticmethod
    def media_type(fmt: str) -> str:
        if fmt not in FORMATS:
            raise FieldError("format", f"must be one of {', '.join(FORMATS)}", where="query")
        return FORMATS[fmt]

    def listen(self, job_id: str, idx: int, fmt: str) -> Listening:
        """A place for one more listener of the track, its relay started if it is the first; raises
        ``TooManyListeners`` past the caps."""
        key = (job_id, idx)
        feed = self.feeds.get(key)
        if self.listeners >= self.most:
            raise TooManyListeners(
                f"This dispatcher has its most live listeners ({self.most}, LIVE_LISTENERS_MAX); try again shortly."
            )
        if feed is not None and feed.listeners >= self.per_track:
            raise TooManyListeners(
                f"Track {idx} of job {job_id} has its most live listeners ({self.per_track}, "
                "LIVE_LISTENERS_PER_TRACK); try again shortly."
            )
        if feed is None:
            feed = self.feeds[key] = TrackFeed(f"{job_id}/{idx}", self._pcm(job_id, idx), self.folder)
            log.info("job %s track %d: live relay started", job_id, idx)
        feed.listeners += 1
        self.listeners += 1
        return Listening(self, key, feed, fmt)

    def left(self, key: Key, feed: TrackFeed) -> None:
        """A listener went: the last of a track's closes its relay."""
        feed.listeners -= 1
        self.listeners -= 1
        if feed.listeners == 0:
            if self.feeds.get(key) is feed:
                del self.feeds[key]
            log.info("job %s track %d: live relay closed (no listener left)", *key)
            task = asyncio.get_running_loop().create_task(feed.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        """Shutting down: every relay stops (its listeners' streams end incomplete)."""
        feeds, self.feeds = list(self.feeds.values()), {}
        await asyncio.gather(*(f.close() for f in feeds), *self._closing, return_exceptions=True)

    async def _pcm(self, job_id: str, idx: int) -> AsyncIterator[bytes]:
        """Whole sample frames from wherever the track's audio is, continuing at the same sample."""
        sent = 0  # bytes of PCM given so far (whole frames)
        heard: set[str] = set()  # task ids whose live audio has ended
        while True:
            t = (await self.load_job(job_id)).tracks[idx]
            if t.status is TrackStatus.done:
                async for block in final_pcm(self.final_wav(job_id, idx), sent // FRAME_BYTES):
                    yield block
                return
            if t.status.terminal:
                log.info(
                    "job %s track %d: stream cut after %.1f s: the track is %s",
                    job_id,
                    idx,
                    sent / FRAME_BYTES / SAMPLE_RATE,
                    t.status.value,
                )
                raise StreamCut(t.status.value)
            client = self.live_client(t.worker_id) if t.status.running and t.task_id not in heard else None
            if client is None or t.task_id is None:
                since = self.changes.version
                await self.changes.wait(since, WAIT_SEC)
                continue
            rest = b""
            try:
                async for data in client.live_chunks(t.task_id, sent):
                    rest += data
                    whole = len(rest) - len(rest) % FRAME_BYTES
                    if whole:
                        sent += whole
                        yield rest[:whole]
                        rest = rest[whole:]
                heard.add(t.task_id)
            except (WorkerUnreachable, WorkerFault) as exc:
                log.info(
                    "job %s track %d: live audio from worker %d broke (%s); asking again", job_id, idx, t.worker_id, exc
                )
                await asyncio.sleep(RETRY_SEC)


class LiveResponse(StreamingResponse):
    """A stream that can be cut: on ``StreamCut`` the body is left unfinished (no last chunk), so the
    listener's client sees an incomplete transfer instead of a song that just ends. ``on_close`` runs
    when the response ends, however it ends (the listener's place is given back)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None], **kw: object) -> None:
        super().__init__(content, **kw)  # type: ignore[arg-type]
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except StreamCut:
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})
