"""The MCP tools: their names, what each says to an assistant, and their arguments.

Each argument is a field of the HTTP API's own models (``songserve/schemas``: ``GenerateRequest``,
``ContinueFrom``) or of its query (``GET /jobs``), copied with its type, limits and description, so
the tools and the HTTP API cannot drift apart (``tests/unit/test_mcp_schemas.py`` compares them). The
argument models forbid unknown names: an assistant's misspelt argument is an error naming it, not a
value silently left out. What a tool does is ``calls.py``; this module only describes.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, create_model
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from songserve.api.service import job_list
from songserve.api.settings import DispatcherSettings
from songserve.schemas import JOB_ID_PATTERN, MAX_WAIT_SEC, NO_CONTROL, ContinueFrom, GenerateRequest

SONG_FIELDS = (
    "tags",
    "prompt",
    "prompt_mode",
    "mode",
    "lyrics",
    "duration",
    "num_tracks",
    "seed",
    "adapter",
    "adapter_scale",
    "takes",
)
RETAKE_SONG_FIELDS = ("tags", "prompt", "prompt_mode", "lyrics", "duration", "num_tracks", "seed")
EDIT_SONG_FIELDS = ("tags", "prompt", "prompt_mode", "lyrics", "num_tracks", "seed")  # an edit keeps its length
STRICT = ConfigDict(extra="forbid")


def mirrored(model: type[BaseModel], name: str, required: bool = False) -> tuple[Any, FieldInfo]:
    """The field ``name`` of an HTTP model as an argument: its type, limits and description (``required``:
    without its default, and its ``None`` taken out of the type)."""
    info = copy.deepcopy(model.model_fields[name])
    annotation = info.annotation
    if required:
        info.default = PydanticUndefined
        args = [a for a in getattr(annotation, "__args__", ()) if a is not type(None)]
        annotation = args[0] if len(args) == 1 else annotation
    return annotation, info


def _arguments(name: str, doc: str, **fields: tuple[Any, Any]) -> type[BaseModel]:
    model: type[BaseModel] = create_model(name, __config__=STRICT, __doc__=doc, **fields)  # type: ignore[call-overload]
    return model


JobId = (str, Field(max_length=64, pattern=JOB_ID_PATTERN, description="the job's id (make_song's job_id)"))

MakeSong = _arguments(
    "MakeSong",
    "POST /generate's fields an assistant needs.",
    **{f: mirrored(GenerateRequest, f) for f in SONG_FIELDS},
    continue_from=mirrored(GenerateRequest, "continue_from"),
)
Retake = _arguments(
    "Retake",
    "POST /generate with continue_from naming a take.",
    job_id=mirrored(ContinueFrom, "job_id", required=True),
    track_index=mirrored(ContinueFrom, "track_index"),
    at_sec=mirrored(ContinueFrom, "at_sec", required=True),
    **{f: mirrored(GenerateRequest, f) for f in RETAKE_SONG_FIELDS},
)
Repaint = _arguments(
    "Repaint",
    "POST /generate with continue_from naming a take and a part of it (at_sec to end_sec) or several (parts).",
    job_id=mirrored(ContinueFrom, "job_id", required=True),
    track_index=mirrored(ContinueFrom, "track_index"),
    at_sec=mirrored(ContinueFrom, "at_sec"),
    end_sec=mirrored(ContinueFrom, "end_sec"),
    parts=mirrored(ContinueFrom, "parts"),
    **{f: mirrored(GenerateRequest, f) for f in EDIT_SONG_FIELDS},
)
ExtendStart = _arguments(
    "ExtendStart",
    "POST /generate with continue_from naming a take and an opening of before_sec seconds.",
    job_id=mirrored(ContinueFrom, "job_id", required=True),
    track_index=mirrored(ContinueFrom, "track_index"),
    before_sec=mirrored(ContinueFrom, "before_sec", required=True),
    **{f: mirrored(GenerateRequest, f) for f in EDIT_SONG_FIELDS},
)
WaitForJob = _arguments(
    "WaitForJob",
    "Prefer: wait=N on a job.",
    job_id=JobId,
    timeout_sec=(int, Field(30, ge=1, le=MAX_WAIT_SEC, description="seconds to wait at most for the job's end")),
)
JobRef = _arguments("JobRef", "A job by its id (GET or DELETE /job/{job_id}).", job_id=JobId)
ListJobs = _arguments(
    "ListJobs",
    "GET /jobs's query.",
    limit=(int, Field(job_list.DEFAULT_LIMIT, ge=1, le=job_list.MAX_LIMIT, description="jobs in one page")),
    cursor=(str | None, Field(None, pattern=job_list.CURSOR_PATTERN, description="a page's next_cursor: older jobs")),
)
NoArguments = _arguments("NoArguments", "A tool that takes nothing.")


def upload_arguments(s: DispatcherSettings) -> type[BaseModel]:
    """``upload_audio``'s arguments, bounded by what one MCP message may carry here (``MCP_MAX_MB``)."""
    cap = max_audio_bytes(s)
    return _arguments(
        "UploadAudio",
        "POST /uploads's file, as base64.",
        audio_base64=(
            str,
            Field(
                max_length=4 * math.ceil(cap / 3),
                description=f"the audio file's bytes as base64 "
                f"(WAV, FLAC, OGG, MP3, …; at most {cap / 2**20:g} MB before encoding)",
            ),
        ),
        filename=(str, Field("upload", max_length=200, pattern=NO_CONTROL, description="its name, shown only")),
    )


def max_audio_bytes(s: DispatcherSettings) -> int:
    """The most audio one MCP message carries: ``MCP_MAX_MB``, within ``UPLOAD_MAX_MB``."""
    return int(min(s.mcp_max_mb, s.upload_max_mb) * 2**20)


@dataclass(frozen=True)
class ToolSpec:
    name: str
    title: str
    description: str
    arguments: type[BaseModel]
    read_only: bool = False
    destructive: bool = False


NOT_FETCHED = (
    "A URL is not taken: the dispatcher does not fetch addresses for a caller, since it would reach whatever its own "
    "network reaches on a stranger's behalf (server-side request forgery) and spend its bandwidth on any file."
)


def tool_specs(s: DispatcherSettings) -> list[ToolSpec]:
    """Every tool, with the limits of this dispatcher in its words."""
    limits = (
        f"On this dispatcher duration is {s.min_duration:g} to {s.max_duration:g} minutes and num_tracks at most "
        f"{s.max_tracks}. Values are checked strictly: one out of range is an error naming it, never clamped."
    )
    takes = (
        "Each finished take is a resource, song://{job_id}/{track} (MP3; song://{job_id}/{track}.wav for the WAV), "
        "and an HTTP download link."
    )
    return [
        ToolSpec(
            "make_song",
            "Make a song",
            "Start a song from a style (tags such as 'pop, piano' — list_style_tags names them — or a prompt with "
            "prompt_mode 'natural') and lyrics ([verse], [chorus] sections; mode 'instrumental' for none). "
            f"num_tracks takes are made in parallel, each a different version. {limits} Answers at once with "
            "the job_id: follow it with wait_for_job. continue_from continues a take or an upload_audio file. "
            "adapter (list_adapters names them) makes it in a fine-tuned sound; takes gives each take its own.",
            MakeSong,
        ),
        ToolSpec(
            "wait_for_job",
            "Wait for a song",
            "Wait until the job has ended or timeout_sec passed, reporting the takes' progress as it goes, then "
            f"answer the job's state. {takes} A job still running after the timeout is answered as it is: "
            "wait again.",
            WaitForJob,
            read_only=True,
        ),
        ToolSpec(
            "get_job",
            "A song's state",
            f"The job's state now: each take's status, progress and phase. {takes}",
            JobRef,
            read_only=True,
        ),
        ToolSpec(
            "list_jobs",
            "My songs",
            "The jobs made with this API key, newest first, a page at a time.",
            ListJobs,
            read_only=True,
        ),
        ToolSpec(
            "retake",
            "Retake from a second",
            "Keep a finished take up to at_sec seconds and generate the rest again as a new job (new lyrics or "
            f"style if given; what is left out stays the original's). {limits}",
            Retake,
        ),
        ToolSpec(
            "repaint",
            "Repaint a part",
            "Write the part of a finished take between at_sec and end_sec again (new lyrics or style for it if "
            "given) and keep everything else exactly: each take rejoins the original within a second of end_sec, "
            "where the two agree best, and is as long as the original. Several parts at once: parts, a list of "
            "{at_sec, end_sec} in order, instead of at_sec and end_sec. num_tracks candidates in one job; "
            "a take's metadata.repainted says where it joined and which samples changed.",
            Repaint,
        ),
        ToolSpec(
            "extend_start",
            "Extend at the start",
            "Write a new opening of about before_sec seconds before a finished take, joined into its first "
            "seconds where the two agree best; from the join on the take is kept exactly. (To extend at the "
            "end, retake from a second near the end with a longer duration.)",
            ExtendStart,
        ),
        ToolSpec(
            "cancel_job",
            "Cancel a song",
            "Stop the job: its queued and running takes end (finished ones stay). Cancelling a finished job "
            "changes nothing.",
            JobRef,
            destructive=True,
        ),
        ToolSpec(
            "list_style_tags",
            "Style tags",
            "The tags the model was trained on, by group (genre, vocals and instruments, mood, production): "
            "choose make_song's tags from these.",
            NoArguments,
            read_only=True,
        ),
        ToolSpec(
            "list_adapters",
            "Adapters",
            "The fine-tuned sounds (LoRA adapters) this fleet can make songs with: make_song's adapter, with an "
            "adapter_scale for how strongly (0 is the base model).",
            NoArguments,
            read_only=True,
        ),
        ToolSpec(
            "upload_audio",
            "Upload audio",
            "Store a person's own audio (base64 of the file) so a song can continue it: make_song with "
            f"continue_from {{'upload_id': …, 'at_sec': …}}. {NOT_FETCHED}",
            upload_arguments(s),
        ),
    ]
