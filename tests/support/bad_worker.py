"""A stand-in for our worker that misbehaves on command: our worker's real HTTP surface, with faults.

    python tests/support/bad_worker.py --mode MODE --worker-port P --output-dir DIR [any worker flag]

It is the real worker (``songserve.worker``, test tone pipeline by default) behind an ASGI layer
that, by ``MODE``, breaks one part of the contract the way a broken or hostile worker would:

    none       behaves
    garbage    ``/generate`` and ``/generate_batch`` answer protocol garbage and run nothing: in turn a
               body that is not JSON, a JSON list, ``{"status": "ok"}`` (a 200 without the fields),
               a result with wrong types, an unknown status
    drip       result downloads send one byte every half second (``--drip-sec``), for ever
    oversize   the WAV download is the file, then zeros without end (no Content-Length)
    truncate   the WAV download is the first half of the file (a consistent HTTP answer; the result's
               sizes and checksums are those of the whole file)
    short      the WAV is cut to half its frames with its header rewritten to match, and the result's
               sizes and checksums are those of the cut file: only its length betrays it

``GET /misbehave`` answers ``{"mode", "task_calls", "streams"}``: ``task_calls`` counts every
``/generate`` and ``/generate_batch`` call, ``streams`` is how many seconds each drip or oversize
download lasted before the client went away. ``POST /misbehave {"mode": …}`` changes the mode.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

import soundfile as sf
import uvicorn
from starlette.responses import JSONResponse, Response, StreamingResponse

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from songserve.process.logs import setup_logging  # noqa: E402
from songserve.process.settings import load_settings  # noqa: E402
from songserve.worker.app import create_app  # noqa: E402
from songserve.worker.main import build_runtime  # noqa: E402
from songserve.worker.outputs import file_facts  # noqa: E402
from songserve.worker.settings import WorkerSettings  # noqa: E402

MODES = ("none", "garbage", "drip", "oversize", "truncate", "short")
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

GARBAGE: list[tuple[int, bytes]] = [
    (200, b"<html>502 Bad Gateway</html>"),
    (200, b"[1, 2, 3]"),
    (200, b'{"status": "ok"}'),
    (
        200,
        b'{"status": "ok", "wav_filename": 5, "mp3_filename": [], "duration_sec": "long", "backbone_tokens": 1,'
        b' "gpu_id": 0, "seed": 1}',
    ),
    (200, b'{"status": "finished", "task_id": "x"}'),
]


class Misbehave:
    def __init__(self, app: App, out_dir: Path, mode: str, drip_sec: float = 0.5) -> None:
        self.app, self.out_dir, self.mode, self.drip_sec = app, out_dir, mode, drip_sec
        self.task_calls = 0
        self.streams: list[float] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, mode = scope["path"], self.mode
        if path == "/misbehave":
            return await self.control(scope, receive, send)
        if path in ("/generate", "/generate_batch"):
            self.task_calls += 1
            if mode == "garbage":
                code, body = GARBAGE[(self.task_calls - 1) % len(GARBAGE)]
                return await Response(body, code, media_type="application/json")(scope, receive, send)
            if mode == "short":
                return await self.shortened(scope, receive, send)
        if path.startswith("/download/"):
            name = path.removeprefix("/download/")
            file = self.out_dir / name
            if mode == "drip" and file.is_file():
                return await self.stream(self.drip(file), file.stat().st_size)(scope, receive, send)
            if mode == "oversize" and name.endswith(".wav") and file.is_file():
                return await self.stream(self.endless(file), None)(scope, receive, send)
            if mode == "truncate" and name.endswith(".wav") and file.is_file():
                data = file.read_bytes()
                return await Response(data[: len(data) // 2], media_type="audio/wav")(scope, receive, send)
        return await self.app(scope, receive, send)

    async def control(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] == "POST":
            body = b""
            while True:
                message = await receive()
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
            mode = json.loads(body).get("mode")
            if mode not in MODES:
                return await JSONResponse({"error": f"mode is one of {MODES}"}, 400)(scope, receive, send)
            self.mode = mode
        view = {"mode": self.mode, "task_calls": self.task_calls, "streams": self.streams}
        return await JSONResponse(view)(scope, receive, send)

    def stream(self, chunks: AsyncIterator[bytes], length: int | None) -> StreamingResponse:
        headers = {"content-length": str(length)} if length is not None else {}
        return StreamingResponse(chunks, media_type="audio/wav", headers=headers)

    async def drip(self, file: Path) -> AsyncIterator[bytes]:
        started = time.monotonic()
        try:
            for byte in file.read_bytes():
                yield bytes([byte])
                await asyncio.sleep(self.drip_sec)
        finally:
            self.streams.append(round(time.monotonic() - started, 2))

    async def endless(self, file: Path) -> AsyncIterator[bytes]:
        started = time.monotonic()
        try:
            yield file.read_bytes()
            while True:
                yield b"\0" * (1 << 20)
                await asyncio.sleep(0)
        finally:
            self.streams.append(round(time.monotonic() - started, 2))

    async def shortened(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the real route, then cut its WAV in half (header rewritten) and answer facts to match."""
        start: Message = {}
        body = b""

        async def capture(message: Message) -> None:
            nonlocal start, body
            if message["type"] == "http.response.start":
                start = message
            else:
                body += message.get("body", b"")

        await self.app(scope, receive, capture)
        answer = json.loads(body)
        for result in answer.get("results", [answer]):
            if result.get("status") == "ok":
                wav = self.out_dir / result["wav_filename"]
                audio, rate = sf.read(wav, dtype="int16")
                sf.write(wav, audio[: len(audio) // 2], rate, subtype="PCM_16")
                names = [result["wav_filename"], result["mp3_filename"], result["json_filename"]]
                facts = file_facts(self.out_dir, [n for n in names if n])
                result["files"] = {name: f.model_dump() for name, f in facts.items()}
        await Response(json.dumps(answer), start.get("status", 200), media_type="application/json")(
            scope, receive, send
        )


def main() -> None:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--mode", choices=MODES, default="none")
    p.add_argument("--drip-sec", type=float, default=0.5, help="seconds between two bytes of a drip")
    own, rest = p.parse_known_args()
    setup_logging(f"bad-worker[{own.mode}]")
    s = load_settings(WorkerSettings, ["--pipeline", "test", *rest])
    runtime = build_runtime(s)
    app = Misbehave(create_app(runtime), s.output_dir, own.mode, own.drip_sec)
    uvicorn.run(app, host="127.0.0.1", port=s.worker_port, log_level="warning")


if __name__ == "__main__":
    main()
