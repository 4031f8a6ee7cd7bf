"""A result copy whose connection breaks before the answer is asked once more, on real sockets.

A pooled keep-alive connection that the worker closes as the dispatcher reuses it breaks before any
status line (seen on loopback under load: the track was charged to the worker and made again). That
copy is asked again once; a copy that breaks after its answer began is the worker's fault at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httpx

from songserve.api.workers.client import WorkerClient, WorkerHttp
from songserve.api.workers.outcomes import WorkerFault
from tests.support.http import TLS

BODY = b"x" * 100_000
Handler = Callable[[int, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _copy(handler: Handler) -> tuple[bytes | str, int]:
    """What ``file_chunks`` gives (its bytes, or the WorkerFault's message) and how many connections it made."""
    made = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal made
        made += 1
        await reader.readuntil(b"\r\n\r\n")
        await handler(made, reader, writer)
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with httpx.AsyncClient(verify=TLS) as http:
            client = WorkerClient(WorkerHttp.shared(http), f"http://127.0.0.1:{port}")
            try:
                got: bytes | str = b"".join([c async for c in client.file_chunks("take.wav", 1 << 20)])
            except WorkerFault as exc:
                got = str(exc)
    finally:
        server.close()
        await server.wait_closed()
    return got, made


def _answer(body: bytes, length: int | None = None) -> bytes:
    head = f"HTTP/1.1 200 OK\r\ncontent-type: audio/wav\r\ncontent-length: {length or len(body)}\r\n\r\n"
    return head.encode() + body


def test_a_connection_closed_before_the_answer_is_asked_once_more() -> None:
    async def first_closes(n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if n > 1:
            writer.write(_answer(BODY))
            await writer.drain()

    assert asyncio.run(_copy(first_closes)) == (BODY, 2)


def test_a_worker_that_never_answers_is_charged_after_the_second_try() -> None:
    async def never(n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        return None

    got, made = asyncio.run(_copy(never))
    assert made == 2
    assert isinstance(got, str)
    assert got.startswith("Copying take.wav from worker http://127.0.0.1:")
    assert "broke (RemoteProtocolError)" in got


def test_a_copy_cut_after_its_answer_began_is_not_asked_again() -> None:
    async def cut(n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(_answer(BODY[:1000], length=len(BODY)))  # announces 100 kB, sends 1 kB
        await writer.drain()

    got, made = asyncio.run(_copy(cut))
    assert made == 1
    assert isinstance(got, str)
    assert "broke (" in got
