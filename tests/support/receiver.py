"""A real webhook receiver on the loopback for tests: an HTTP server thread that records every request.

``answers`` scripts the status of the next requests (then ``default``); ``hits`` holds each request's
headers (lower-case names) and body, in arrival order. Used by the in-process and the real-process
webhook tests alike (the dispatcher under test sends to it over real sockets).
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Hit:
    headers: dict[str, str]
    body: bytes
    at: float

    @property
    def event(self) -> dict[str, Any]:
        parsed: dict[str, Any] = json.loads(self.body)
        return parsed

    @property
    def id(self) -> str:
        return self.headers["webhook-id"]


class Receiver:
    def __init__(self, default: int = 200) -> None:
        self.default = default
        self.answers: deque[int] = deque()
        self.delays: deque[float] = deque()  # seconds before each next answer (a slow receiver)
        self.hits: list[Hit] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # the standard library's name
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                with receiver.lock:
                    receiver.hits.append(Hit({k.lower(): v for k, v in self.headers.items()}, body, time.time()))
                    status = receiver.answers.popleft() if receiver.answers else receiver.default
                    delay = receiver.delays.popleft() if receiver.delays else 0.0
                time.sleep(delay)
                try:
                    self.send_response(status)
                    self.send_header("content-length", "0")
                    self.end_headers()
                except OSError:  # the sender gave up on a slow answer and closed the connection
                    pass

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook?token=t0"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def events(self, kind: str | None = None) -> list[Hit]:
        with self.lock:
            return [h for h in self.hits if kind is None or h.event["type"] == kind]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
