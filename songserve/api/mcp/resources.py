"""A job's takes as MCP resources: the audio itself, and its lyrics and style as text.

``song://{job_id}/{track}`` is a finished take's MP3 and ``song://{job_id}/{track}.wav`` its WAV, read
from the same files ``GET /job/{id}/track/{i}/mp3`` serves (``JobService.track_file``: done, present, of
its recorded size) and sent as a base64 blob with its MIME type; ``song://{job_id}/lyrics`` and
``song://{job_id}/style`` are text. A file larger than ``MCP_MAX_MB`` is refused with its HTTP link
instead, so one read never holds more than that (and its base64) in memory. The key's scope is the
HTTP API's: another key's job is not found.
"""

from __future__ import annotations

import asyncio
import base64
import re
from dataclasses import dataclass

import mcp_types as types

from songserve.api.mcp.calls import take_uri
from songserve.api.service.job_service import JobService
from songserve.api.service.keys import Caller
from songserve.errors import NotFoundError, RequestError

URI = re.compile(
    r"^song://(?P<job>[a-f0-9]{8,64})/(?:(?P<track>\d{1,4})(?:\.(?P<kind>mp3|wav))?|(?P<text>lyrics|style))$"
)
MIME = {"mp3": "audio/mpeg", "wav": "audio/wav"}
TEMPLATES = [
    types.ResourceTemplate(
        name="take",
        title="A finished take (MP3)",
        uri_template="song://{job_id}/{track}",
        mime_type="audio/mpeg",
        description="track: the take's index, from 0",
    ),
    types.ResourceTemplate(
        name="take_wav",
        title="A finished take (WAV)",
        uri_template="song://{job_id}/{track}.wav",
        mime_type="audio/wav",
        description="16-bit PCM, 44.1 kHz stereo; about 10 MB a minute",
    ),
    types.ResourceTemplate(
        name="lyrics",
        title="A song's lyrics",
        uri_template="song://{job_id}/lyrics",
        mime_type="text/plain",
        description="as cleaned and sung",
    ),
    types.ResourceTemplate(
        name="style",
        title="A song's style",
        uri_template="song://{job_id}/style",
        mime_type="text/plain",
        description="its tags, or its prompt in natural mode",
    ),
]


@dataclass(frozen=True)
class Reader:
    jobs: JobService
    caller: Caller | None
    base_url: str
    max_bytes: int

    async def read(self, uri: str) -> types.ReadResourceResult:
        m = URI.match(uri)
        if m is None:
            raise NotFoundError(
                f"No resource {uri[:200]!r}: they are song://<job_id>/<track>[.wav], "
                "song://<job_id>/lyrics and song://<job_id>/style."
            )
        job_id = m["job"]
        job = await self.jobs.visible(job_id, self.caller)
        if m["text"]:
            r = job.request
            text = job.cleaned_lyrics if m["text"] == "lyrics" else (r.prompt if r.prompt_mode == "natural" else r.tags)
            return types.ReadResourceResult(
                contents=[types.TextResourceContents(uri=uri, mime_type="text/plain", text=text)]
            )
        kind, index = m["kind"] or "mp3", int(m["track"])
        f = await self.jobs.track_file(job_id, index, kind)
        size = await asyncio.to_thread(lambda: f.path.stat().st_size)
        if size > self.max_bytes:
            raise RequestError(
                f"The {kind} file of track {index} of job {job_id} is {size / 2**20:.1f} MB, more than "
                f"one MCP message carries here (MCP_MAX_MB, {self.max_bytes / 2**20:g} MB); download "
                f"it from {self.base_url}/job/{job_id}/track/{index}/{kind}."
            )
        data = await asyncio.to_thread(f.path.read_bytes)
        blob = base64.b64encode(data).decode("ascii")
        return types.ReadResourceResult(contents=[types.BlobResourceContents(uri=uri, mime_type=MIME[kind], blob=blob)])

    async def recent(self) -> list[types.Resource]:
        """The finished takes of the caller's newest jobs (one page of ``GET /jobs``), for clients that browse."""
        page = await self.jobs.jobs(self.caller, 20, None)
        return [
            types.Resource(
                uri=take_uri(j.job_id, t.index),
                name=f"{j.job_id} take {t.index}",
                title=f"{(j.asked.tags or j.asked.prompt)[:60] or 'song'} (take {t.index})",
                mime_type="audio/mpeg",
                description=f"{t.duration_sec:.0f} s; {self.base_url}{t.files.mp3}",
            )
            for j in page.jobs
            for t in j.tracks
            if t.files is not None
        ]
