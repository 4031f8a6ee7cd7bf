"""The key before the body, on both ports, through a real dispatcher.

A dispatcher with an API key and ACE-Step's port, and no worker. Without a key in the header a body
is read only up to ``MAX_BODY_BYTES`` (it may carry ``ai_token``): a flood of 60,000 tiny parts or a
100 MB file part is a 401 at once, unread, and ``/health`` answers on both ports throughout (a body
read before the key is checked stalls the process 12 s and costs +1.1 GiB). With the key, multipart
is read as it streams with caps on parts: 60,000 parts are a 400 after the 256th. On our own port a
chunked body (no Content-Length) without a key is a 401 before it is read (not read first by the
body limit).
"""

from __future__ import annotations

import httpx
import pytest

from tests.support.http import TLS
from tests.support.load_probe import HealthWatch, peak_mib, raw_request
from tests.support.servers import ServerProcess, free_port

KEY = "s3cret"
MIB = 2**20


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    port, ace = free_port(), free_port()
    args = ["backend_api.py", "--port", str(port), "--acestep-port", str(ace), "--state-dir", str(tmp / "state")]
    proc = ServerProcess([*args, "--num-workers", "0", "--api-key", KEY], port, tmp / "api.log")
    proc.wait_healthy(want=("ok",))
    proc.ace_port = ace  # type: ignore[attr-defined]
    yield proc
    proc.stop()


def tiny_parts(n: int) -> bytes:
    return (
        b"".join(b'--zz\r\nContent-Disposition: form-data; name="f%d"\r\n\r\nx\r\n' % i for i in range(n))
        + b"--zz--\r\n"
    )


def big_file_part(megabytes: int) -> tuple[bytes, bytes, bytes]:
    """(the part's head, one MiB of its data, its tail): the body is head + MiB × megabytes + tail."""
    head = b'--zz\r\nContent-Disposition: form-data; name="src_audio"; filename="a.wav"\r\n\r\n'
    return head, b"\0" * MIB, b"\r\n--zz--\r\n"


def release(keyed: ServerProcess, body_len: int, authorization: str = "") -> str:
    head = (
        f"POST /release_task HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=zz\r\n"
        f"Content-Length: {body_len}"
    )
    return head + (f"\r\nAuthorization: {authorization}" if authorization else "")


@pytest.mark.parametrize("flood", ["60,000 tiny parts", "a 100 MB file part"])
def test_an_unauthenticated_multipart_flood_on_acestep_is_refused_unread(keyed, flood):
    pid, ace = keyed.proc.pid, keyed.ace_port
    if flood == "60,000 tiny parts":
        body = tiny_parts(60_000)
        pieces, size = [body[i : i + MIB] for i in range(0, len(body), MIB)], len(body)
    else:
        head, mib, tail = big_file_part(100)
        pieces, size = [head, *([mib] * 100), tail], len(head) + 100 * MIB + len(tail)
    before = peak_mib(pid)
    with HealthWatch(keyed.url, f"http://127.0.0.1:{ace}") as health:
        # the flood is sent only once the answer is in: an answer at all says the body was never waited for
        status, answer, took = raw_request(
            ace, release(keyed, size), rest=iter(pieces), timeout=60, rest_after_answer=True
        )
    growth = peak_mib(pid) - before
    print(f"{flood}: {status} in {took:.3f} s, peak growth {growth:.0f} MiB, /health slowest {health.slowest:.2f} s")
    assert status == 401
    assert b"Missing ai_token or Authorization header (a body over MAX_BODY_BYTES" in answer
    assert health.slowest < 2.0
    assert growth < 3 * size / MIB + 100


def test_with_the_key_a_multipart_of_too_many_parts_is_400_at_the_cap(keyed):
    body = tiny_parts(60_000)
    with HealthWatch(keyed.url) as health:
        r = httpx.post(
            f"http://127.0.0.1:{keyed.ace_port}/release_task",
            content=body,
            headers={"Content-Type": "multipart/form-data; boundary=zz", "Authorization": f"Bearer {KEY}"},
            timeout=60,
            verify=TLS,
        )
    assert r.status_code == 400
    assert r.json()["detail"] == "The multipart/form-data body has more than 256 parts."
    assert health.slowest < 2.0


def test_a_wrong_header_with_a_large_body_is_401_unread_and_a_small_body_may_carry_the_token(keyed):
    head, mib, tail = big_file_part(20)
    size = len(head) + 20 * MIB + len(tail)
    status, answer, _ = raw_request(
        keyed.ace_port, release(keyed, size, "Bearer wrong"), head, [mib] * 20 + [tail], rest_after_answer=True
    )
    assert status == 401  # answered from the headers and the body's first bytes: the rest was sent after
    assert b"Invalid API key (a body over MAX_BODY_BYTES" in answer
    small = httpx.post(
        f"http://127.0.0.1:{keyed.ace_port}/release_task",
        data={"ai_token": KEY, "prompt": "x"},
        files={"src_audio": ("a.wav", b"not audio", "audio/wav")},
        headers={"Authorization": "Bearer wrong"},
        timeout=30,
        verify=TLS,
    )
    assert small.status_code == 200, small.text  # the body's ai_token (checked first, as ACE-Step does) let it in
    assert small.json()["data"]["status"] == "queued"


def test_our_port_refuses_a_chunked_body_without_a_key_before_reading_it(keyed):
    head = (
        "POST /uploads HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=zz\r\n"
        "Transfer-Encoding: chunked"
    )
    first = b"%x\r\n%s\r\n" % (MIB, b"\0" * MIB)  # one chunk; the rest never comes
    status, answer, _ = raw_request(keyed.port, head, first, timeout=30)  # a server that waits times out here
    assert status == 401
    assert b"Missing or wrong credentials" in answer
