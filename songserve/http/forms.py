"""Request bodies as they arrive: multipart forms parsed block by block off the event loop, within caps.

Both dialects read files this way (``POST /uploads``; ACE-Step's multipart ``/release_task``), so a
body never sits whole in memory and a hostile one costs a bounded amount of work:

- ``python-multipart``'s streaming parser is fed ``FEED_BYTES`` at a time on the forms' own small
  executor (``EXECUTOR``), so 60,000 tiny parts or a 100 MB part never stall the event loop;
- a file part goes to a spooled temporary file (in memory up to ``SPOOL_BYTES``, then on disk);
  a field is kept in memory up to ``FormLimits.field_bytes``;
- refused with a sentence (``FormError``: 400 or 413) as soon as a cap is passed: the whole body
  (``body_bytes``), any part's headers (python-multipart's own cap), more than ``MAX_PARTS`` parts,
  more than ``MAX_FILES`` file parts, a field over ``field_bytes``, a file over ``file_bytes``, a
  boundary that is not there, or a body that ends before its closing boundary.

A field sent twice keeps its last value (as the standard library's parser did for ACE-Step's
routes). Fields are UTF-8 unless the part names another charset; a file part is one with a
``filename`` in its ``Content-Disposition``. ``spool`` is the same for a raw body (no form).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import IO

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header

from songserve.errors import RequestError

FEED_BYTES = 1 << 20  # body bytes gathered before one hand-over to the executor
SPOOL_BYTES = 1 << 20  # a file part (or a spooled body) up to this stays in memory, past it on disk
MAX_PARTS = 256  # ACE-Step's /release_task reads about 60 fields; a form has no use for thousands
MAX_FILES = 4  # ACE-Step's task takes two audio files at most (src_audio, reference_audio), ours one
BACKGROUND_NICE = 10  # how much less CPU time the body and upload threads get than the event loop's thread


def background_thread() -> None:
    """A thread initializer: this thread yields the CPU to the event loop's (Linux schedules threads
    one by one), so ``/health`` and every other answer keep their latency while bodies are read and
    files decoded on a busy machine. Where it cannot be done, nothing changes."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except (AttributeError, OSError):
        pass


EXECUTOR = ThreadPoolExecutor(2, thread_name_prefix="form", initializer=background_thread)  # parsing: short steps


class FormError(RequestError):
    """A body refused while it was read: ``status`` (400, or 413 for a size) and a sentence."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = self.http_status = status


@dataclass(frozen=True)
class FormLimits:
    """The caps of one route's body; ``too_large`` is the 413's sentence when the whole body is too big."""

    body_bytes: int
    field_bytes: int
    file_bytes: int
    too_large: str = ""

    def body_error(self) -> FormError:
        return FormError(413, self.too_large or f"The request body is larger than {self.body_bytes} bytes.")


@dataclass
class FilePart:
    """A file field: its bytes in ``file`` (positioned at 0 once the form is read), ``size`` of them."""

    field: str
    filename: str
    content_type: str
    file: IO[bytes]
    size: int = 0


@dataclass
class Form:
    fields: dict[str, str] = field(default_factory=dict)
    files: dict[str, FilePart] = field(default_factory=dict)

    def close(self) -> None:
        for f in self.files.values():
            f.file.close()


class FormReader:
    """A multipart body fed in pieces (``feed``), checked as it goes; ``finish`` answers the form."""

    def __init__(self, content_type: str, limits: FormLimits) -> None:
        _, params = parse_options_header(content_type)
        boundary = params.get(b"boundary")
        if not boundary:
            raise FormError(400, "The multipart/form-data body cannot be read (check its boundary: none is given).")
        self.limits = limits
        self.form = Form()
        self.size = 0
        self.parts = 0
        self.ended = False
        self._headers: dict[bytes, bytes] = {}
        self._name, self._value = b"", b""
        self._file: FilePart | None = None
        self._field: str | None = None
        self._charset = "utf-8"
        self._data = bytearray()
        self.parser = MultipartParser(
            boundary,
            {
                "on_part_begin": self._part_begin,
                "on_header_field": self._header_field,
                "on_header_value": self._header_value,
                "on_header_end": self._header_end,
                "on_headers_finished": self._headers_finished,
                "on_part_data": self._part_data,
                "on_part_end": self._part_end,
                "on_end": self._end,
            },
        )

    def feed(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > self.limits.body_bytes:
            raise self.limits.body_error()
        try:
            self.parser.write(data)
        except FormParserError as exc:
            raise FormError(400, f"The multipart/form-data body cannot be read (check its boundary): {exc}") from None

    def finish(self) -> Form:
        """The form, once the whole body was fed: every file back at its start."""
        if not self.ended:
            raise FormError(
                400,
                "The multipart/form-data body cannot be read (check its boundary): it ends "
                "before its closing boundary.",
            )
        for f in self.form.files.values():
            f.file.seek(0)
        return self.form

    def close(self) -> None:
        self.form.close()
        if self._file is not None:
            self._file.file.close()

    # the parser's callbacks, in the order it calls them for each part
    def _part_begin(self) -> None:
        self.parts += 1
        if self.parts > MAX_PARTS:
            raise FormError(400, f"The multipart/form-data body has more than {MAX_PARTS} parts.")
        self._headers, self._file, self._field, self._data = {}, None, None, bytearray()

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._name += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def _header_end(self) -> None:
        self._headers[self._name.lower()] = self._value
        self._name, self._value = b"", b""

    def _headers_finished(self) -> None:
        _, params = parse_options_header(self._headers.get(b"content-disposition", b""))
        name = params.get(b"name", b"").decode("utf-8", "replace")
        if not name:
            return  # a part without a name is not a field: skipped
        ctype, ct_params = parse_options_header(self._headers.get(b"content-type", b""))
        if b"filename" in params:
            if len(self.form.files) + 1 > MAX_FILES:
                raise FormError(400, f"The multipart/form-data body has more than {MAX_FILES} files.")
            spooled = tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES)
            filename = params[b"filename"].decode("utf-8", "replace")
            self._file = FilePart(name, filename, ctype.decode("latin-1") or "application/octet-stream", spooled)
        else:
            self._field = name
            self._charset = ct_params.get(b"charset", b"utf-8").decode("latin-1")

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._file is not None:
            self._file.size += end - start
            if self._file.size > self.limits.file_bytes:
                raise FormError(
                    413,
                    self.limits.too_large
                    or f"The file '{self._file.field}' is larger than {self.limits.file_bytes} bytes.",
                )
            self._file.file.write(data[start:end])
        elif self._field is not None:
            if len(self._data) + end - start > self.limits.field_bytes:
                raise FormError(413, f"Field '{self._field}' is larger than {self.limits.field_bytes} bytes.")
            self._data += data[start:end]

    def _part_end(self) -> None:
        if self._file is not None:
            old = self.form.files.pop(self._file.field, None)
            if old is not None:
                old.file.close()
            self.form.files[self._file.field] = self._file
            self._file = None
        elif self._field is not None:
            try:
                text = self._data.decode(self._charset, errors="replace")
            except LookupError:
                text = self._data.decode("utf-8", errors="replace")
            self.form.fields[self._field] = text

    def _end(self) -> None:
        self.ended = True


async def read_form(chunks: AsyncIterator[bytes], content_type: str, limits: FormLimits) -> Form:
    """A multipart body from the request's stream, parsed on ``EXECUTOR`` ``FEED_BYTES`` at a time."""
    reader = FormReader(content_type, limits)
    loop = asyncio.get_running_loop()
    try:
        async for batch in _batches(chunks, limits):
            await loop.run_in_executor(EXECUTOR, reader.feed, batch)
        return reader.finish()
    except BaseException:
        await loop.run_in_executor(EXECUTOR, reader.close)
        raise


async def spool(chunks: AsyncIterator[bytes], max_bytes: int, too_large: str = "") -> IO[bytes]:
    """A raw body in a spooled temporary file (positioned at 0), written off the event loop."""
    limits = FormLimits(max_bytes, 0, 0, too_large)
    f = tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES)
    loop = asyncio.get_running_loop()
    try:
        async for batch in _batches(chunks, limits):
            await loop.run_in_executor(EXECUTOR, f.write, batch)
        f.seek(0)
        return f
    except BaseException:
        f.close()
        raise


async def _batches(chunks: AsyncIterator[bytes], limits: FormLimits) -> AsyncIterator[bytes]:
    """The stream gathered into pieces of about ``FEED_BYTES``; past ``body_bytes``, ``FormError`` (413)."""
    pending: list[bytes] = []
    held = total = 0
    async for chunk in chunks:
        total += len(chunk)
        if total > limits.body_bytes:
            raise limits.body_error()
        pending.append(chunk)
        held += len(chunk)
        if held >= FEED_BYTES:
            yield b"".join(pending)
            pending, held = [], 0
    if pending:
        yield b"".join(pending)
