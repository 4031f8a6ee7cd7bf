"""One live track's bytes as they are made, written once and read by every listener.

A listener hears a track from its start, whenever it joined, so a track's stream is one sequence of
bytes that grows: one writer appends (the track's relay, or its MP3 encoder), any number of readers
read from their own offsets and wait for more. Why a file: a running track may be ten minutes of
PCM (106 MB), and a dispatcher may relay many, so memory holds only the newest ``tail`` bytes (the
part that listeners who keep up read) and the rest is read back from an unlinked temporary file
(gone with the process), off the event loop on the relay's own threads (``LIVE_IO``), so renders or
uploads that fill the default executor never hold a listener back.

The file descriptor is used by positional reads and writes only (``os.pread``/``os.pwrite``: no
shared offset between threads) and is closed once the spool is closed *and* no read is in flight, so
a read never meets a closed or reused descriptor.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

READ_BYTES = 1 << 16  # at most this much per read
LIVE_IO = ThreadPoolExecutor(max_workers=2, thread_name_prefix="live-io")  # the spools' file reads and writes


class StreamCut(Exception):
    """The track ended without audio while a listener was hearing it: the stream is cut."""


class Spool:
    """Bytes appended by one writer and read by many, from any offset (see the module docstring)."""

    def __init__(self, folder: Path, tail_bytes: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self._file = tempfile.TemporaryFile(dir=folder, prefix="live-")
        self._fd = self._file.fileno()
        self._tail: deque[tuple[int, bytes]] = deque()  # (offset, bytes): the newest pieces, in order
        self._tail_bytes, self._tail_max = 0, tail_bytes
        self.size = 0  # bytes readable (written to the file and in the tail)
        self.ended = False  # the writer is done: a read at ``size`` gets b""
        self.cut: str | None = None  # why the stream was cut (the track failed or was cancelled)
        self._grew = asyncio.Event()
        self._io = 0  # file reads and writes in flight
        self._closed = False

    async def append(self, data: bytes) -> None:
        """Write ``data`` at the end (the one writer's call, awaited before the next)."""
        if not data or self._closed:
            return
        at = self.size
        await self._on_file(os.pwrite, self._fd, data, at)
        if self._closed:
            return
        self._tail.append((at, data))
        self._tail_bytes += len(data)
        while self._tail_bytes - len(self._tail[0][1]) >= self._tail_max:
            self._tail_bytes -= len(self._tail.popleft()[1])
        self.size = at + len(data)
        self._wake()

    def finish(self, cut: str | None = None) -> None:
        """No more bytes: the stream ends (``cut``: it ends incomplete, saying why)."""
        self.ended, self.cut = True, cut
        self._wake()

    def _wake(self) -> None:
        self._grew.set()
        self._grew = asyncio.Event()

    async def read(self, offset: int) -> bytes:
        """The bytes at ``offset`` (up to ``READ_BYTES``), waiting for them; b"" at the end.

        ``StreamCut`` when the stream was cut, once every byte written before the cut was read, and
        at once when the spool is closed (its file may be gone)."""
        if self._closed:
            raise StreamCut(self.cut or "closed")
        while offset >= self.size:
            if self.ended:
                if self.cut is not None:
                    raise StreamCut(self.cut)
                return b""
            await self._grew.wait()
        if self._tail and offset >= self._tail[0][0]:
            return self._from_tail(offset)
        data: bytes = await self._on_file(os.pread, self._fd, min(READ_BYTES, self.size - offset), offset)
        return data

    def _from_tail(self, offset: int) -> bytes:
        """Up to ``READ_BYTES`` from the pieces in memory, joined (fewer, larger sends to a listener)."""
        out, want = [], READ_BYTES
        for start, piece in self._tail:
            end = start + len(piece)
            if offset >= end:
                continue
            part = piece[offset - start : offset - start + want]
            out.append(part)
            offset, want = offset + len(part), want - len(part)
            if not want:
                break
        return b"".join(out)

    async def _on_file(self, call: Callable[..., Any], *args: object) -> Any:
        """``call(*args)`` on the file, off the loop; the file is closed only once no call is in flight
        (a call cancelled here still runs to its end in its thread)."""
        loop = asyncio.get_running_loop()
        self._io += 1
        running = LIVE_IO.submit(call, *args)
        running.add_done_callback(lambda _: loop.call_soon_threadsafe(self._io_done))  # in its thread, at its end
        return await asyncio.wrap_future(running)

    def _io_done(self) -> None:
        self._io -= 1
        if self._closed and not self._io:
            self._file.close()

    def close(self) -> None:
        """Nobody reads it any more: its file goes (now, or when the last read in flight returns)."""
        if self._closed:
            return
        self._closed = True
        self._tail.clear()
        self.finish(self.cut or "closed")
        if not self._io:
            self._file.close()
