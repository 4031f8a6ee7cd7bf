"""``GET /tasks/{task_id}/stream``: a running take's live audio, followed as the pipeline writes it.

The body is 16-bit little-endian PCM at the decoder's rate and channels (44.1 kHz stereo), no
header; ``start`` skips bytes already heard (a dispatcher that reconnects). Asking is wanting:
the take's live audio starts being made (``LiveAudio.want``) if it was not already.

The answer ends, normally, when the take ends (done, failed or cancelled) or when its live audio
can go no further (missed, failed); only the dispatcher, which knows how the track ended, can
say what the listener hears next (the final audio, or an aborted stream). Between the end of
the live audio and the end of the take (super-resolution, decoder, files) the connection stays
open and quiet, so a relay does not have to ask again.

Slow readers cost nothing: each read is at most ``CHUNK`` bytes from the file, made when the
previous one was taken. The file is read on the event loop: each read is at most 64 KiB of page
cache the pipeline has just written, a few microseconds, cheaper than a thread hop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from songserve.errors import NotFoundError, RequestError
from songserve.pipeline.context import TaskContext
from songserve.pipeline.live_audio.take import LiveAudio, LiveState
from songserve.worker.tasks import TaskRegistry

CHUNK = 1 << 16
POLL_SEC = 0.05  # how often a caught-up reader looks for more


class NoLiveAudio(RequestError):
    """The task has no live audio to give (it ended, it was missed, or live audio is off): 409."""

    http_status = 409


def open_live(tasks: TaskRegistry, task_id: str, enabled: bool, start: int) -> TaskContext:
    """The running take whose live audio is asked for, now wanted; or why there is none."""
    ctx = tasks.running(task_id)
    if ctx is None:
        view = tasks.get(task_id)
        if view is None:
            raise NotFoundError(f"Task {task_id} is not known to this worker.")
        raise NoLiveAudio(f"Task {task_id} is {view.status.value}: it has no live audio; its files are its audio.")
    if not enabled:
        raise NoLiveAudio("Live audio is off on this worker (PREVIEW_CHUNK_SEC=0).")
    if start < 0 or start % (2 * ctx.live.channels):
        raise RequestError(f"start must be a whole number of sample frames ({2 * ctx.live.channels} bytes each).")
    state = ctx.live.want()
    if state in (LiveState.missed, LiveState.failed):
        raise NoLiveAudio(
            f"Task {task_id} has no live audio ({state.value}{': ' + ctx.live.error if ctx.live.error else ''})."
        )
    return ctx


async def follow(live: LiveAudio, start: int, running: Callable[[], bool]) -> AsyncIterator[bytes]:
    """The live file from byte ``start``, as it grows; ends once the take is over (``running()`` false)
    with nothing left to read, or once its live audio can give no more."""
    sent, f = start, None
    try:
        while True:
            if f is None and live.path is not None:
                try:
                    f = open(live.path, "rb")  # held across yields: closed in the finally below
                    f.seek(sent)
                except FileNotFoundError:  # the take ended and its file went before we opened it
                    return
            # Only whole sample frames: bytes_written counts what the writer has finished appending.
            data = f.read(min(CHUNK, live.bytes_written - sent)) if f is not None and live.bytes_written > sent else b""
            if data:
                sent += len(data)
                yield data
                continue
            state = live.state
            if not running() or state in (LiveState.missed, LiveState.failed):
                return
            await asyncio.sleep(POLL_SEC)
    finally:
        if f is not None:
            f.close()
