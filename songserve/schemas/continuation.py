"""Continuing or repainting a song: the client's ``continue_from`` and the code grid a worker works from.

The two are kept apart on purpose. ``ContinueFrom`` names a finished take (a job, a track, a
second) or an upload (a person's own audio, encoded by a worker: ``upload_id``, and a second that
defaults to its end), and with ``end_sec`` a part to repaint, or with ``parts`` several; the dispatcher
resolves it into a ``PrefixCodes``: the kept frames themselves (for a repaint the whole grid and its
``RepaintSpan``, or one per part), which is all a worker needs. A worker never looks a job or an upload up: both reach it the same way.
"""

from __future__ import annotations

import base64
import binascii
import math
import re

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from songserve.schemas.common import JOB_ID_PATTERN, NO_CONTROL

CODEBOOK_SIZE = 1024  # codes of every level are in [0, 1024)
MAX_LEVELS = 64
# 15 minutes (the worker's longest request) of 44,100 / 2,048 frames per second
FRAMES_PER_SECOND = 44_100 / 2_048
MAX_PREFIX_FRAMES = math.ceil(15 * 60 * FRAMES_PER_SECOND)
JOB_ID = re.compile(JOB_ID_PATTERN)
MAX_REPAINT_PARTS = 8  # parts of one repaint: each is a backbone pass over the take
MAX_PREFIX_CHARS = 4 * math.ceil(MAX_LEVELS * MAX_PREFIX_FRAMES * 2 / 3)  # base64 of that many int16 codes


class RepaintPart(BaseModel):
    """One part of a repaint of several: the take is written anew from ``at_sec`` and rejoins the
    original near ``end_sec``, as a single repaint's ``at_sec``/``end_sec`` do."""

    model_config = ConfigDict(extra="forbid")

    at_sec: float = Field(gt=0, allow_inf_nan=False, description="seconds into the take: the part starts here")
    end_sec: float = Field(
        gt=0, allow_inf_nan=False, description="the part ends near this second, where it rejoins the original"
    )

    @field_validator("end_sec")
    @classmethod
    def _after_start(cls, value: float, info: ValidationInfo) -> float:
        at = info.data.get("at_sec")
        if at is not None and value <= at:
            raise ValueError("end_sec must come after at_sec: the part between them is repainted")
        return value


class ContinueFrom(BaseModel):
    """``POST /generate``'s ``continue_from``: keep a take's (or an upload's) frames before ``at_sec``,
    generate the rest. Exactly one of ``job_id`` and ``upload_id``; a take needs ``at_sec`` (or ``parts``)."""

    model_config = ConfigDict(extra="forbid")

    # The pattern is checked by ``_an_id`` (a sentence, not the regex) and kept in the schema for clients.
    job_id: str | None = Field(
        None,
        max_length=64,
        json_schema_extra={"pattern": JOB_ID_PATTERN},
        description="the job of the take to continue",
    )
    track_index: int = Field(0, ge=0, le=1000, description="which of its takes")
    upload_id: str | None = Field(
        None,
        max_length=64,
        json_schema_extra={"pattern": JOB_ID_PATTERN},
        description="or an upload (POST /uploads) to continue",
    )
    at_sec: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="seconds into the take or upload: what comes before is kept (an upload: its end if left out)",
    )
    end_sec: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description=(
            "repaint: the new part ends near this second and the take rejoins the original there (at the frame "
            "within the join window where the two agree best), keeping the rest exactly; left out, the new part "
            "runs to the song's end"
        ),
    )
    parts: list[RepaintPart] | None = Field(
        None,
        min_length=2,
        max_length=MAX_REPAINT_PARTS,
        description=(
            "repaint several parts in one request, in order of their start, instead of at_sec and end_sec: "
            "each part is written anew and rejoins the original at its own join; the rest is kept exactly"
        ),
    )
    before_sec: float | None = Field(
        None,
        gt=0,
        le=MAX_PREFIX_FRAMES / FRAMES_PER_SECOND,
        allow_inf_nan=False,
        description=(
            "extend at the start: a new opening about this many seconds long, joined into the song's first "
            "seconds where the two agree best; the song after the join is kept exactly"
        ),
    )

    def edits(self) -> bool:
        """A part of the song is written anew and the rest kept (a repaint, several, a new opening), as
        against a retake, which writes everything after ``at_sec``."""
        return self.end_sec is not None or self.parts is not None or self.before_sec is not None

    @field_validator("job_id", "upload_id")
    @classmethod
    def _an_id(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and not JOB_ID.match(value):
            what, route = ("a job", "POST /generate") if info.field_name == "job_id" else ("an upload", "POST /uploads")
            raise ValueError(
                f"{value!r} is not {what} id: ids are the 8 to 64 lowercase hex digits that {route} "
                f"answers as {info.field_name}"
            )
        return value

    @model_validator(mode="after")
    def _one_source(self) -> ContinueFrom:
        if (self.job_id is None) == (self.upload_id is None):
            raise ValueError("name either a take (job_id, track_index, at_sec) or an upload (upload_id)")
        if self.before_sec is not None:
            if self.at_sec is not None or self.end_sec is not None or self.parts is not None:
                raise ValueError("before_sec extends the song at its start: it takes no at_sec, end_sec or parts")
            return self
        if self.parts is not None:
            if self.at_sec is not None or self.end_sec is not None:
                raise ValueError("parts names where each part starts and ends: send it instead of at_sec and end_sec")
            return self
        if self.job_id is not None and self.at_sec is None:
            raise ValueError("at_sec is needed to continue a take: the second its new part starts at")
        if self.end_sec is not None and (self.at_sec is None or self.end_sec <= self.at_sec):
            raise ValueError("end_sec must come after at_sec: the part between them is repainted")
        return self


class RepaintSpan(BaseModel):
    """Which frames of a ``PrefixCodes`` grid a repaint writes anew, in frames.

    The take keeps frames ``[0, start)``, writes from ``start`` on, and rejoins the original at a frame
    ``join`` within ``window`` frames of ``end`` (where the new coarse codes and the original's agree
    best), keeping frames ``[join, frames)`` of the grid exactly: the take is as long as the grid.

    An extension at the start is the same with ``opening`` > 0: the grid's first ``opening`` frames are
    placeholders for the new opening (their codes mean nothing), ``start`` is 0 (nothing kept before),
    and the join lands at or after them, inside the original."""

    model_config = ConfigDict(extra="ignore")

    start: int = Field(ge=0, le=MAX_PREFIX_FRAMES)
    end: int = Field(ge=1, le=MAX_PREFIX_FRAMES)
    window: int = Field(0, ge=0, le=MAX_PREFIX_FRAMES)
    opening: int = Field(0, ge=0, le=MAX_PREFIX_FRAMES)

    @model_validator(mode="after")
    def _kept_or_opened(self) -> RepaintSpan:
        if self.opening == 0 and self.start == 0:
            raise ValueError("a repaint keeps at least one frame before its start (start ≥ 1) unless it opens the song")
        if self.opening > 0 and (self.start != 0 or self.end < self.opening):
            raise ValueError("an opening starts at frame 0 and ends at or after its placeholder frames")
        return self


class PrefixCodes(BaseModel):
    """Dispatcher → worker, with a task: the new take starts with exactly these frames (with ``repaint``:
    the take is this grid with the span's part written anew).

    ``codes`` is base64 of ``levels × frames`` little-endian int16 values, level-major (row ``c``
    holds level ``c`` of every frame), each in [0, 1024). ``origin`` labels where the grid came
    from (the dispatcher sends ``<job_id>/<track_index>``); the worker reports it with the KV
    snapshots it keeps, so a dispatcher can send the next continuation of the same take to the
    worker that holds its prefix.
    """

    model_config = ConfigDict(extra="ignore")

    levels: int = Field(ge=1, le=MAX_LEVELS)
    frames: int = Field(ge=1, le=MAX_PREFIX_FRAMES)
    codes: str = Field(max_length=MAX_PREFIX_CHARS, repr=False)
    origin: str = Field("", max_length=200, pattern=NO_CONTROL)
    repaint: RepaintSpan | None = None  # the grid is a whole take: keep its start and end, write this part anew
    # several parts, in order (the first is ``repaint`` too): each written anew from its start, with its own join
    parts: list[RepaintSpan] | None = Field(None, min_length=2, max_length=MAX_REPAINT_PARTS)

    @model_validator(mode="after")
    def _codes_fit(self) -> PrefixCodes:
        for span in self.spans():
            if not span.start < span.end <= self.frames:
                raise ValueError(f"repaint {span.start}..{span.end} is not a part of the grid's {self.frames} frames")
        if self.parts is not None:
            if self.repaint != self.parts[0]:
                raise ValueError("repaint must be the first of the parts")
            for a, b in zip(self.parts, self.parts[1:], strict=False):
                if b.opening or b.start <= a.end + a.window:
                    raise ValueError(
                        f"repaint part {b.start}..{b.end} starts within the join window of the part before it"
                    )
        try:
            raw = base64.b64decode(self.codes, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("codes is not base64") from None
        if len(raw) != 2 * self.levels * self.frames:
            raise ValueError(
                f"codes holds {len(raw)} bytes; {self.levels} levels × {self.frames} frames need "
                f"{2 * self.levels * self.frames}"
            )
        return self

    def raw(self) -> bytes:
        """The int16 values, little-endian, level-major."""
        return base64.b64decode(self.codes)

    def spans(self) -> list[RepaintSpan]:
        """Every part written anew, in order: the parts, or the one repaint, or none."""
        if self.parts is not None:
            return list(self.parts)
        return [self.repaint] if self.repaint is not None else []

    @classmethod
    def of(
        cls, raw: bytes, levels: int, frames: int, origin: str = "", parts: list[RepaintSpan] | None = None
    ) -> PrefixCodes:
        """A grid as the wire has it; ``parts``: the spans a repaint writes anew (one: today's ``repaint`` alone,
        which every worker of ours reads; several: ``parts`` beside it)."""
        repaint = parts[0] if parts else None
        several = parts if parts is not None and len(parts) > 1 else None
        code = base64.b64encode(raw).decode()
        return cls(levels=levels, frames=frames, codes=code, origin=origin, repaint=repaint, parts=several)
