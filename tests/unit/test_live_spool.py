"""The live relay's parts in-process: the spool every listener of a track reads, and the
one MP3 encoder per track that is never used by two threads at once."""

from __future__ import annotations

import asyncio
import io
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from songserve.api.service.live_feed import Mp3Stream, TrackFeed
from songserve.api.service.live_spool import READ_BYTES, Spool, StreamCut


async def read_all(spool: Spool, offset: int = 0) -> bytes:
    out = bytearray()
    while data := await spool.read(offset + len(out)):
        out += data
    return bytes(out)


def test_every_reader_gets_every_byte_from_its_offset_whether_in_memory_or_read_back(tmp_path: Path) -> None:
    async def main() -> None:
        spool = Spool(tmp_path, tail_bytes=10_000)  # most of it only in the file
        data = np.random.default_rng(1).integers(0, 256, 300_000, dtype=np.uint8).tobytes()
        early, late = asyncio.create_task(read_all(spool)), None
        for i in range(0, len(data), 7_000):
            await spool.append(data[i : i + 7_000])
            if i > 200_000 and late is None:
                late = asyncio.create_task(read_all(spool, 123_456))  # joins late, starts in the file
        spool.finish()
        assert await early == data
        assert late is not None
        assert await late == data[123_456:]
        assert await read_all(spool, 299_000) == data[299_000:]
        assert len(await spool.read(0)) == READ_BYTES  # joined pieces, not one small piece per read
        spool.close()

    asyncio.run(main())


def test_a_cut_spool_gives_what_it_had_then_raises(tmp_path: Path) -> None:
    async def main() -> None:
        spool = Spool(tmp_path, tail_bytes=1 << 20)
        waiting = asyncio.create_task(read_all(spool))
        await spool.append(b"abcd")
        spool.finish(cut="cancelled")
        with pytest.raises(StreamCut, match="cancelled"):
            await waiting
        assert await spool.read(0) == b"abcd"
        spool.close()

    asyncio.run(main())


def test_a_spool_closed_during_a_read_keeps_its_file_until_the_read_returns(tmp_path: Path) -> None:
    async def main() -> None:
        spool = Spool(tmp_path, tail_bytes=1)
        await spool.append(b"x" * 100_000)
        await spool.append(b"y")  # the first piece is out of memory now
        reader = asyncio.create_task(spool.read(0))
        await asyncio.sleep(0)
        reader.cancel()
        spool.close()
        await asyncio.gather(reader, return_exceptions=True)
        for _ in range(100):  # the read in its thread ends, then the file is closed
            if spool._file.closed:
                break
            await asyncio.sleep(0.01)
        assert spool._file.closed

    asyncio.run(main())


def test_the_encoder_is_never_entered_by_two_threads_and_ends_once() -> None:
    mp3 = Mp3Stream()
    pcm = np.zeros((44_100, 2), dtype="<i2").tobytes()
    out = bytearray()
    threads = [threading.Thread(target=lambda: out.extend(mp3.feed(pcm))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out += mp3.end()
    assert mp3.end() == b""
    assert mp3.feed(pcm) == b""
    audio, rate = sf.read(io.BytesIO(bytes(out)), dtype="int16")
    assert rate == 44_100
    assert abs(len(audio) - 8 * 44_100) < 3 * 1152


def test_a_feed_closed_mid_encode_drops_its_encoder_and_the_listeners_mp3_decodes_when_whole(tmp_path: Path) -> None:
    tone = (np.sin(np.arange(44_100 * 4) / 20) * 8000).astype("<i2").repeat(2).tobytes()

    async def source() -> AsyncIterator[bytes]:
        for i in range(0, len(tone), 1 << 16):
            yield tone[i : i + (1 << 16)]

    async def main() -> None:
        feed = TrackFeed("job/0", source(), tmp_path)
        whole = await read_all(feed.spool("mp3"))
        audio, _ = sf.read(io.BytesIO(whole), dtype="int16")
        assert abs(len(audio) - 44_100 * 4) < 3 * 1152
        await feed.close()
        for _ in range(20):  # closed at any moment, while its encoder may be encoding: no crash
            busy = TrackFeed("job/1", source(), tmp_path)
            busy.spool("mp3")
            await asyncio.sleep(0.001)
            await busy.close()

    asyncio.run(main())
