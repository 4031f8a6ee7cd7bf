"""One live track's relay, shared by every listener of that track on this dispatcher.

Why shared: every listener hears the track from its start, so all of them hear the same bytes. One
task reads the track's PCM once (one connection to its worker, however many listen) into a
``Spool``; when a listener asks for MP3, one encoder makes the MP3 once, from that PCM, into a
second spool. Listeners only read spools, so a crowd costs sockets and reads, never connections to
a worker, encoders or CPU per head.

The encoder is a native object (LAME): it is used by one thread at a time, always. Its feeds are
awaited one after another by its one task, on the feed's own threads (``LIVE_MP3``), its flush runs
there too, and a feed that is closed while an encode is in flight drops the encoder without
flushing it: the thread finishes the encode and nothing touches the encoder again (its memory goes
with its last reference, the thread's). An encoder flushed on the event loop while a cancelled feed
still encodes with it is a SIGSEGV, or LAME's assertions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import lameenc

from songserve.api.service.live_spool import Spool, StreamCut

log = logging.getLogger(__name__)
SAMPLE_RATE, CHANNELS = 44_100, 2  # the decoder's (docs/model.md); the worker's stream says the same
LIVE_MP3_KBPS, LIVE_MP3_QUALITY = 192, 5  # the stream's MP3: CBR, LAME's quality (2 best … 7 fast)
PCM_TAIL = 4 << 20  # bytes of the newest PCM kept in memory (~24 s), the rest read back from its file
MP3_TAIL = 1 << 20  # bytes of the newest MP3 kept in memory (~44 s at 192 kbps)
LIVE_MP3 = ThreadPoolExecutor(max_workers=2, thread_name_prefix="live-mp3")  # the feeds' encoders


class Mp3Stream:
    """PCM in, MP3 out as it is encoded (blocking: call off the event loop, one call at a time).

    LAME through ``lameenc``, constant 192 kbps, LAME quality 5: about 0.7 s of one core per minute
    of stereo audio here, a seventh of libsndfile's MP3 writer (4.7 s). The lock makes "one thread at
    a time" hold whoever calls."""

    def __init__(self) -> None:
        self._enc = lameenc.Encoder()
        self._enc.set_bit_rate(LIVE_MP3_KBPS)
        self._enc.set_in_sample_rate(SAMPLE_RATE)
        self._enc.set_channels(CHANNELS)
        self._enc.set_quality(LIVE_MP3_QUALITY)
        self._lock = threading.Lock()
        self._ended = False

    def feed(self, pcm: bytes) -> bytes:
        with self._lock:
            return b"" if self._ended else bytes(self._enc.encode(pcm))

    def end(self) -> bytes:
        with self._lock:
            if self._ended:
                return b""
            self._ended = True
            return bytes(self._enc.flush())


class TrackFeed:
    """The relay of one track (``name``: ``job/index``, for logs) from ``source`` into spools."""

    def __init__(self, name: str, source: AsyncIterator[bytes], folder: Path) -> None:
        self.name = name
        self.listeners = 0  # counted by ``LiveStreams``; the feed closes when it falls to 0
        self.folder = folder
        self.pcm = Spool(folder, PCM_TAIL)
        self.mp3: Spool | None = None
        self._tasks = [asyncio.create_task(self._relay(source), name=f"live-{name}")]

    def spool(self, fmt: str) -> Spool:
        """What a listener of ``fmt`` reads: the PCM, or the MP3 (its encoder started on first asking)."""
        if fmt != "mp3":
            return self.pcm
        if self.mp3 is None:
            self.mp3 = Spool(self.folder, MP3_TAIL)
            self._tasks.append(asyncio.create_task(self._encode(self.mp3), name=f"live-mp3-{self.name}"))
        return self.mp3

    async def _relay(self, source: AsyncIterator[bytes]) -> None:
        try:
            async with contextlib.aclosing(source) as blocks:  # type: ignore[type-var]
                async for block in blocks:
                    await self.pcm.append(block)
        except StreamCut as exc:
            self.pcm.finish(cut=str(exc))
        except Exception as exc:  # never a silent end: the listeners' streams are cut, the log says why
            log.exception("live %s: the relay failed", self.name)
            self.pcm.finish(cut=f"the relay failed ({type(exc).__name__})")
        else:
            self.pcm.finish()

    async def _encode(self, out: Spool) -> None:
        mp3, offset, loop = Mp3Stream(), 0, asyncio.get_running_loop()
        try:
            while block := await self.pcm.read(offset):
                offset += len(block)
                await out.append(await loop.run_in_executor(LIVE_MP3, mp3.feed, block))
            await out.append(await loop.run_in_executor(LIVE_MP3, mp3.end))
        except StreamCut as exc:
            out.finish(cut=str(exc))
        except Exception as exc:
            log.exception("live %s: the MP3 encoder failed", self.name)
            out.finish(cut=f"the encoder failed ({type(exc).__name__})")
        else:
            out.finish()

    async def close(self) -> None:
        """Nobody listens any more: stop relaying and encoding (an encode in flight ends in its thread,
        its encoder dropped unflushed), and let the spools' files go."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.pcm.close()
        if self.mp3 is not None:
            self.mp3.close()
