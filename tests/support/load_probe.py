"""What a hostile load costs a real process: its peak memory (``VmHWM``) and how long ``/health`` takes meanwhile.

``peak_mib`` reads the kernel's high-water mark of a process's resident memory, so a peak between
two polls is never missed; ``HealthWatch`` asks ``/health`` back to back on a thread for as long as
the load runs and keeps the slowest answer (a failed one counts as its whole timeout). ``raw_request``
speaks HTTP/1.1 over a socket, for what a client library will not do: send a body's start, then
read the answer before the rest (or while another thread sends it).
"""

from __future__ import annotations

import os
import re
import socket
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import httpx

from tests.support.http import TLS

FAVOURED_NICE = -10  # the measured process's event-loop thread, over the suite's other processes


def favoured(pid: int) -> str:
    """Give the main thread of ``pid`` (its event loop) a share of the cores the suite's other
    processes cannot take from it (nice ``FAVOURED_NICE``), so that a lag measured there is the
    process's own, not how long the kernel ran a parallel test's processes first. What was done, for
    the test's printed line (raising a priority needs root or CAP_SYS_NICE: elsewhere it stays)."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, FAVOURED_NICE)
    except PermissionError:
        return "its priority as it was (raising it needs root)"
    return f"its event loop at nice {FAVOURED_NICE}"


def peak_mib(pid: int) -> float:
    """The process's peak resident memory so far, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


class HealthWatch:
    """``/health`` of each URL asked in turn until ``stop``; ``slowest`` is the longest wait seen (seconds)."""

    def __init__(self, *urls: str, timeout: float = 10.0) -> None:
        self.urls, self.timeout = urls, timeout
        self.slowest, self.asked, self.failed = 0.0, 0, 0
        self._done, self._round = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._round.wait(self.timeout * len(self.urls) + 5)  # every URL asked at least once, however short the load
        self._done.set()
        self._thread.join(self.timeout + 5)

    def _run(self) -> None:
        with httpx.Client(timeout=self.timeout, verify=TLS) as client:
            while not self._done.is_set():
                for url in self.urls:
                    t0 = time.monotonic()
                    try:
                        ok = client.get(url + "/health").status_code == 200
                    except httpx.HTTPError:
                        ok = False
                    self.slowest = max(self.slowest, time.monotonic() - t0 if ok else self.timeout)
                    self.asked += 1
                    self.failed += not ok
                self._round.set()
                self._done.wait(0.05)


def raw_request(
    port: int,
    head: str,
    first: bytes = b"",
    rest: Iterable[bytes] = (),
    timeout: float = 30.0,
    rest_after_answer: bool = False,
) -> tuple[int, bytes, float]:
    """Send ``head`` (request line and headers, without the blank line) and ``first``; a thread sends
    ``rest`` meanwhile (a closed connection ends it quietly). Answers (status, body, seconds from the
    first byte sent to the answer's first line).

    ``rest_after_answer``: the thread sends ``rest`` only once the answer's first bytes are in, so an
    answer at all proves the server did not wait for the body (one that waits times out here, whatever
    the machine's speed)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    t0 = time.monotonic()
    sock.sendall(head.encode("latin-1") + b"\r\n\r\n" + first)
    answered = threading.Event()

    def send_rest() -> None:
        if rest_after_answer and not answered.wait(timeout):
            return
        try:
            for piece in rest:
                sock.sendall(piece)
        except OSError:
            pass  # the server answered and closed: the rest is not wanted

    sender = threading.Thread(target=send_rest, daemon=True)
    sender.start()
    got = b""
    took = None
    try:
        while b"\r\n\r\n" not in got:
            piece = sock.recv(65536)
            if not piece:
                break
            took = took if took is not None else time.monotonic() - t0
            answered.set()
            got += piece
        header, _, body = got.partition(b"\r\n\r\n")
        length = next(
            (int(h.split(b":")[1]) for h in header.split(b"\r\n") if h.lower().startswith(b"content-length:")), 0
        )
        while len(body) < length:
            piece = sock.recv(65536)
            if not piece:
                break
            body += piece
    finally:
        answered.set()  # a failed read lets a held sender go
        sock.close()
        sender.join(timeout)
    if not got:
        raise ConnectionError("the server closed the connection without an answer")
    return int(header.split(b" ")[1]), body, took if took is not None else time.monotonic() - t0


def lag_counts(url: str) -> tuple[float, float]:
    """(probes of the loop lag so far, those that woke more than a second late)."""
    text = httpx.get(url + "/metrics", timeout=30, verify=TLS).text

    def value(name: str) -> float:
        m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        assert m, f"{name} not in /metrics"
        return float(m.group(1))

    count = value("songserve_event_loop_lag_seconds_count")
    return count, count - value('songserve_event_loop_lag_seconds_bucket{le="1.0"}')


class Crowd:
    """``n`` listeners of one stream on raw sockets, read by one thread until each stream ends.

    Each gets the HTTP status and whether its body ended as a whole chunked transfer (``0\\r\\n\\r\\n``)."""

    def __init__(self, url: str, n: int, deadline_sec: float = 180.0) -> None:
        host, rest = url.removeprefix("http://").split("/", 1)
        self.addr = (host.split(":")[0], int(host.split(":")[1]))
        self.request = f"GET /{rest} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode()
        self.n, self.deadline = n, time.monotonic() + deadline_sec
        self.answers: list[bytes] = []  # each listener's whole answer, head and body
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import selectors

        sel = selectors.DefaultSelector()
        bufs: dict[socket.socket, bytearray] = {}
        for _ in range(self.n):
            sock = socket.create_connection(self.addr, timeout=10)
            sock.sendall(self.request)
            sock.setblocking(False)
            bufs[sock] = bytearray()
            sel.register(sock, selectors.EVENT_READ)
        while bufs and time.monotonic() < self.deadline:
            for key, _ in sel.select(timeout=1.0):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    data = sock.recv(1 << 16)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if data:
                    bufs[sock] += data
                    continue
                sel.unregister(sock)
                sock.close()
                self.answers.append(bytes(bufs.pop(sock)))
        for sock, buf in bufs.items():  # past the deadline: unfinished
            sock.close()
            self.answers.append(bytes(buf))

    @property
    def listening(self) -> bool:
        return self.thread.is_alive()

    def statuses(self) -> list[int]:
        return [int(a.split(b" ", 2)[1]) if a.startswith(b"HTTP/1.1 ") else 0 for a in self.answers]

    def whole(self) -> int:
        return sum(a.endswith(b"\r\n0\r\n\r\n") for a in self.answers)
