"""Request bodies as they arrive (songserve/http/forms.py) and the body limit (http_guard.BodyLimit), in process.

The streaming form reader against bodies httpx writes, fed in any pieces; every cap refuses with its
status and sentence. ``BodyLimit`` over a tiny ASGI app: a chunked body past the limit is a 413 as
soon as the limit is passed, and the app never sees more than the limit.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from songserve.http.forms import MAX_FILES, MAX_PARTS, FormError, FormLimits, FormReader, read_form, spool
from songserve.http.guard import BodyLimit

LIMITS = FormLimits(body_bytes=1 << 20, field_bytes=1000, file_bytes=10_000, too_large="too large, said the route")


def multipart(data: dict, files: dict | None = None) -> tuple[str, bytes]:
    req = httpx.Request("POST", "http://x/", data=data, files=files or {"unused": ("u.txt", b"", "text/plain")})
    return req.headers["content-type"], req.read()


def parts(n: int) -> tuple[str, bytes]:
    body = b"".join(b'--zz\r\nContent-Disposition: form-data; name="f%d"\r\n\r\nx\r\n' % i for i in range(n))
    return "multipart/form-data; boundary=zz", body + b"--zz--\r\n"


def read(ct: str, raw: bytes, limits: FormLimits = LIMITS, piece: int = 0) -> dict:
    reader = FormReader(ct, limits)
    try:
        for i in range(0, len(raw), piece or len(raw) or 1):
            reader.feed(raw[i : i + (piece or len(raw))])
        form = reader.finish()
        out = {
            "fields": form.fields,
            "files": {k: (f.filename, f.content_type, f.file.read(), f.size) for k, f in form.files.items()},
        }
        form.close()
        return out
    except BaseException:
        reader.close()
        raise


@pytest.mark.parametrize("piece", [0, 1, 7, 4096])
def test_fields_and_files_are_read_whatever_the_pieces(piece):
    ct, raw = multipart(
        {"prompt": "流行, piano", "empty": ""}, {"src_audio": ("x.mp3", b"\x00\r\n--\xff" * 50, "audio/mpeg")}
    )
    got = read(ct, raw, piece=piece)
    assert got["fields"] == {"prompt": "流行, piano", "empty": ""}
    assert got["files"] == {"src_audio": ("x.mp3", "audio/mpeg", b"\x00\r\n--\xff" * 50, 300)}


def test_a_field_sent_twice_keeps_its_last_value_and_a_part_without_a_name_is_skipped():
    body = (
        b'--zz\r\nContent-Disposition: form-data; name="a"\r\n\r\n1\r\n'
        b"--zz\r\nContent-Disposition: form-data\r\n\r\nnameless\r\n"
        b'--zz\r\nContent-Disposition: form-data; name="a"\r\nContent-Type: text/plain; charset=latin-1\r\n\r\n\xe9\r\n'
        b"--zz--\r\n"
    )
    assert read("multipart/form-data; boundary=zz", body)["fields"] == {"a": "é"}


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        (parts(MAX_PARTS + 1), 400, f"has more than {MAX_PARTS} parts"),
        (
            multipart({}, {f"f{i}": ("a", b"x", "a/b") for i in range(MAX_FILES + 1)}),
            400,
            f"more than {MAX_FILES} files",
        ),
        (multipart({"big": "x" * 1001}), 413, "Field 'big' is larger than 1000 bytes"),
        (multipart({}, {"file": ("a.wav", b"x" * 10_001, "audio/wav")}), 413, "too large, said the route"),
        (("multipart/form-data", b"--zz--\r\n"), 400, "check its boundary: none is given"),
        (("multipart/form-data; boundary=zz", b"no parts here"), 400, "cannot be read (check its boundary)"),
        ((parts(3)[0], parts(3)[1][:-10]), 400, "ends before its closing boundary"),
    ],
    ids=["parts", "files", "field-size", "file-size", "no-boundary", "wrong-boundary", "cut-short"],
)
def test_each_cap_refuses_with_its_status_and_sentence(body, status, says):
    with pytest.raises(FormError) as err:
        read(*body, piece=4096)
    assert err.value.status == err.value.http_status == status
    assert says in str(err.value)


def test_the_whole_body_is_capped_as_it_arrives():
    async def chunks():
        yield b'--zz\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n\r\n'
        for _ in range(100):
            yield b"\0" * 65536

    async def go() -> None:
        whole = FormLimits(body_bytes=1 << 20, field_bytes=1000, file_bytes=1 << 30, too_large="the whole body")
        with pytest.raises(FormError, match="the whole body") as err:
            await read_form(chunks(), "multipart/form-data; boundary=zz", whole)
        assert err.value.status == 413
        with pytest.raises(FormError, match="larger than MAX_AUDIO_MB"):
            await spool(chunks(), 1 << 20, "larger than MAX_AUDIO_MB")
        f = await spool(chunks(), 101 * 65536)
        assert len(f.read()) > 100 * 65536
        f.close()

    asyncio.run(go())


def test_thousands_of_parts_are_refused_at_the_cap_not_parsed_to_the_end():
    ct, raw = parts(60_000)
    reader = FormReader(ct, FormLimits(len(raw), 1000, 1000))

    def feed_all() -> None:
        for i in range(0, len(raw), 65536):
            reader.feed(raw[i : i + 65536])

    with pytest.raises(FormError, match="more than 256 parts"):
        feed_all()
    assert reader.size <= 2 * 65536  # the piece that crossed the cap was the last one read
    reader.close()


def _asgi_run(limit: int, pieces: list[bytes], headers: list[tuple[bytes, bytes]]) -> tuple[int, int]:
    """(status answered, bytes the app read) for a POST whose body comes in ``pieces``."""
    seen = {"read": 0}

    async def app(scope, receive, send) -> None:
        while True:
            m = await receive()
            if m["type"] == "http.disconnect":
                raise OSError("client went away")  # what a route does when its body stops
            seen["read"] += len(m.get("body", b""))
            if not m.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    messages = [{"type": "http.request", "body": p, "more_body": i < len(pieces) - 1} for i, p in enumerate(pieces)]
    sent: list[dict] = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(m) -> None:
        sent.append(m)

    scope = {"type": "http", "method": "POST", "path": "/x", "headers": headers}
    asyncio.run(BodyLimit(app, limit)(scope, receive, send))
    return sent[0]["status"], seen["read"]


def test_body_limit_counts_a_chunked_body_as_the_app_reads_it():
    assert _asgi_run(100, [b"x" * 40, b"x" * 40], []) == (200, 80)
    status, read_by_app = _asgi_run(100, [b"x" * 60] * 50, [])
    assert status == 413
    assert read_by_app <= 100  # the piece that crossed the limit never reached the app
    assert _asgi_run(100, [b"x" * 10], [(b"content-length", b"1000")]) == (413, 0)  # refused from the header
