"""A track's audio while it is made (issue 23): ``GET /job/{id}/track/{i}/stream`` on any dispatcher.

The relay follows the track wherever it is, as the store tells it (so any dispatcher of a shared
store serves any track): queued, it waits; running on one of our workers, it relays that worker's
live audio (``GET /tasks/{task}/stream``, 16-bit PCM); done, it serves the rest from the final
WAV. The listener hears one stream from the start of the track to its end:

- ``sent`` counts the PCM bytes already given; every source is read from there on, so a retry on
  another worker, a worker reconnected to, or the final file each continue at the same sample;
- a worker's stream ends when its take ends or its live audio can go no further; the relay then
  looks at the track again: done → the rest of the final audio, then the end of the stream;
  failed or cancelled → the stream is cut (the transfer ends incomplete: a player reports an
  error, ``curl`` exits with 18), after a log line saying why; the track's view says it too;
- ``wav``: a RIFF header whose sizes say "unknown" (0xFFFFFFFF), then PCM as it comes; ``mp3``
  (the default: a browser's ``<audio>`` plays it as it arrives): encoded here with LAME, per
  listener, off the event loop. The stream's MP3 has no gapless header (it would have to be written
  first), so a decoder adds LAME's priming samples at its start.

Back-pressure all the way: the relay reads from the worker only as fast as the listener takes
bytes, and the worker reads its file at the same pace, so a slow or vanished listener holds
nothing but a socket; the worker's model thread never waits for anyone.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import lameenc
import soundfile as sf
from starlette.responses import StreamingResponse
from starlette.types import Send

from songserve.api.outcomes import WorkerFault, WorkerUnreachable
from songserve.api.states import TrackStatus
from songserve.api.store import Job
from songserve.api.tracks import ChangeFeed
from songserve.api.worker_client import WorkerClient
from songserve.errors import FieldError, RequestError

log = logging.getLogger(__name__)
SAMPLE_RATE, CHANNELS = 44_100, 2  # the decoder's (docs/model.md); the worker's stream says the same
FRAME_BYTES = 2 * CHANNELS  # one 16-bit sample per channel
FORMATS = {"mp3": "audio/mpeg", "wav": "audio/wav"}
WAIT_SEC = 0.5  # a relay with nothing to relay looks at its track again this often (or on a change here)
RETRY_SEC = 0.5  # after a worker's stream broke
FINAL_BLOCK = SAMPLE_RATE  # sample frames per read of the final WAV
LIVE_MP3_KBPS, LIVE_MP3_QUALITY = 192, 5  # the stream's MP3: CBR, LAME's quality (2 best … 7 fast)


class NoAudio(RequestError):
    """The track ended without audio (failed or cancelled): 409, saying how it ended."""

    http_status = 409


class StreamCut(Exception):
    """The track ended without audio while a listener was hearing it: the stream is cut."""


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


class Mp3Stream:
    """PCM in, MP3 out as it is encoded (blocking: call off the event loop).

    LAME through ``lameenc``, constant 192 kbps, LAME quality 5: about 0.7 s of one core per minute
    of stereo audio here, a seventh of libsndfile's MP3 writer (4.7 s; its compression level changes
    the bitrate, not the work), which matters since every listener has an encoder of its own."""

    def __init__(self) -> None:
        self._enc = lameenc.Encoder()
        self._enc.set_bit_rate(LIVE_MP3_KBPS)
        self._enc.set_in_sample_rate(SAMPLE_RATE)
        self._enc.set_channels(CHANNELS)
        self._enc.set_quality(LIVE_MP3_QUALITY)

    def feed(self, pcm: bytes) -> bytes:
        return bytes(self._enc.encode(pcm))

    def end(self) -> bytes:
        return bytes(self._enc.flush())


async def final_pcm(path: Path, from_frame: int) -> AsyncIterator[bytes]:
    """The final WAV's PCM from sample frame ``from_frame`` on, a block at a time (read off the loop)."""
    f = await asyncio.to_thread(sf.SoundFile, path)
    try:
        if from_frame >= f.frames:
            return
        await asyncio.to_thread(f.seek, from_frame)
        while block := (await asyncio.to_thread(f.read, FINAL_BLOCK, dtype="int16", always_2d=True)).tobytes():
            yield block
    finally:
        f.close()


class LiveStreams:
    """The relay behind ``GET /job/{id}/track/{i}/stream`` (see the module docstring)."""

    def __init__(
        self,
        load_job: Callable[[str], Awaitable[Job]],
        live_client: Callable[[int], WorkerClient | None],
        final_wav: Callable[[str, int], Path],
        changes: ChangeFeed,
    ) -> None:
        self.load_job = load_job
        self.live_client = live_client
        self.final_wav = final_wav
        self.changes = changes

    @staticmethod
    def media_type(fmt: str) -> str:
        if fmt not in FORMATS:
            raise FieldError("format", f"must be one of {', '.join(FORMATS)}", where="query")
        return FORMATS[fmt]

    async def chunks(self, job_id: str, idx: int, fmt: str) -> AsyncIterator[bytes]:
        """The stream's bytes: the header (WAV), then the track's audio from its start to its end."""
        mp3 = Mp3Stream() if fmt == "mp3" else None
        if mp3 is None:
            yield wav_header()
        try:
            async for pcm in self._pcm(job_id, idx):
                yield pcm if mp3 is None else await asyncio.to_thread(mp3.feed, pcm)
        except BaseException:
            if mp3 is not None:
                mp3.end()  # frees the encoder (its last frame is a few ms of work)
            raise
        if mp3 is not None:
            yield await asyncio.to_thread(mp3.end)

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
                log.info("job %s track %d: stream cut after %.1f s: the track is %s", job_id, idx,
                         sent / FRAME_BYTES / SAMPLE_RATE, t.status.value)  # fmt: skip
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
                log.info("job %s track %d: live audio from worker %d broke (%s); asking again", job_id, idx,
                         t.worker_id, exc)  # fmt: skip
                await asyncio.sleep(RETRY_SEC)


class LiveResponse(StreamingResponse):
    """A stream that can be cut: on ``StreamCut`` the body is left unfinished (no last chunk), so the
    listener's client sees an incomplete transfer instead of a song that just ends."""

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except StreamCut:
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})
