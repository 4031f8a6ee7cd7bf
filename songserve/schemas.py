"""Wire models shared by the dispatcher and the worker: the contract in shared/docs/api.md.

Field names and status words here are the compatibility surface with existing frontends; do not
rename them. Unknown request fields are ignored.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# ---- worker -------------------------------------------------------------------------------------


class WorkerPhase(StrEnum):
    idle = "idle"
    loading_backbone = "loading_backbone"
    backbone = "backbone"
    loading_superres = "loading_superres"
    superres = "superres"
    loading_decoder = "loading_decoder"
    decoding = "decoding"


class WorkerStatus(StrEnum):
    initializing = "initializing"
    idle = "idle"
    busy = "busy"
    error = "error"  # the model thread died or loading failed
    stalled = "stalled"  # a task made no progress past its deadline


# Every worker field is bounded; names and ids also have a pattern (no newline to forge a log line,
# no control characters in a name). pydantic refuses lone surrogates in any string ("\ud800" is
# valid JSON but not valid Unicode). Bad input is a 422 naming the field, never a 500.
NO_CONTROL = r"^[^\x00-\x1f\x7f]*$"
ID_PATTERN = r"^[A-Za-z0-9_.-]*$"
WORD_PATTERN = r"^[A-Za-z_]*$"
MAX_SEED = 2**63 - 1  # fits SQLite's INTEGER and torch's manual_seed


class ErrorKind(StrEnum):
    """Why a task failed: whose fault, so the dispatcher knows whether another worker may succeed."""

    environment = "environment"  # disk full, out of memory, a write error: this worker, not the track
    model = "model"  # the model or the export failed on this input
    request = "request"  # the request cannot be served as asked (unknown model name, …)


class WorkerGenerateRequest(BaseModel):
    """Dispatcher → worker ``POST /generate``."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    genre: str = Field("", max_length=200, pattern=NO_CONTROL)
    language: str = Field("", max_length=100, pattern=NO_CONTROL)
    tags: str = Field("", max_length=2000)
    description: str = Field("", max_length=4000)
    duration: float = Field(0.5, gt=0, le=15, description="minutes")
    lyrics: str = Field("", max_length=20000)
    backbone_name: str = Field("", max_length=200, pattern=NO_CONTROL)
    superres_name: str = Field("", max_length=200, pattern=NO_CONTROL)
    top_k_bb: int = Field(80, ge=1, le=1024)
    top_k_sr: int = Field(10, ge=1, le=1024)
    temperature: float = Field(1.0, gt=0, le=5)
    superres_text_mode: str = Field("default", max_length=32, pattern=WORD_PATTERN)
    raw_user_input: str = Field("", max_length=4000)
    raw_mode: str = Field("vocal", max_length=32, pattern=WORD_PATTERN)
    raw_prompt_mode: str = Field("tags", max_length=32, pattern=WORD_PATTERN)
    seed_override: int | None = Field(None, ge=0, le=MAX_SEED)
    task_id: str = Field("", max_length=64, pattern=ID_PATTERN)
    job_id: str = Field("", max_length=64, pattern=ID_PATTERN)
    track_index: int = Field(0, ge=0, le=1000)


class WorkerGenerateResult(BaseModel):
    status: Literal["ok"] = "ok"
    task_id: str
    mp3_filename: str
    wav_filename: str
    json_filename: str
    duration_sec: float
    backbone_tokens: int
    gpu_id: int
    seed: int
    metadata: dict = {}
    error_kind: ErrorKind | None = None  # always None on success; the field is shared with error bodies


class TaskState(StrEnum):
    running = "running"
    ok = "ok"
    error = "error"
    cancelled = "cancelled"


class TaskView(BaseModel):
    """``GET /tasks/{task_id}``: what became of a task."""

    task_id: str
    status: TaskState
    error: str | None = None
    error_kind: ErrorKind | None = None
    result: WorkerGenerateResult | None = None
    progress: int = 0
    phase: str = "idle"


# ---- dispatcher ---------------------------------------------------------------------------------


class GenerateRequest(BaseModel):
    """``POST /generate``. Ranges that are configurable are checked again against the settings."""

    model_config = ConfigDict(extra="allow", strict=True)

    mode: Literal["vocal", "instrumental"] = "vocal"
    prompt_mode: Literal["tags", "natural"] = "tags"
    prompt: str = Field("", max_length=1000)
    tags: str = Field("", max_length=1000)
    lyrics: str = Field("", max_length=50_000, description="≤ 10,000 characters after cleaning")
    duration: float = Field(3.0, gt=0, description="minutes")
    top_k_bb: int = Field(80, ge=1, le=200)
    temperature: float = Field(1.0, ge=0.6, le=1.4)
    num_tracks: int = Field(2, ge=1)
    seed: int | None = Field(None, ge=0, le=2**31 - 1)
    top_k_sr: int = Field(10, ge=1, le=1024)
    backbone: str | None = None
    superres: str | None = None
    priority: int = Field(0, ge=0, le=9)


class GenerateAccepted(BaseModel):
    status: Literal["accepted", "queued"]
    job_id: str
    num_tracks: int
    queue_position: int


class TrackFiles(BaseModel):
    mp3: str
    wav: str


class TrackView(BaseModel):
    index: int
    status: str
    progress: int = 0
    phase_display: str = "Queued"
    worker_id: int = -1
    worker_phase: str = "idle"
    duration_sec: float = 0.0
    error: str | None = None
    seed: int | None = None
    attempts: int = 0
    queue_position: int = 0
    files: TrackFiles | None = None
    metadata: dict = {}


class JobView(BaseModel):
    job_id: str
    status: str
    queue_position: int = 0
    cleaned_lyrics: str = ""
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    eta_sec: float | None = None
    priority: int = 0
    tracks: list[TrackView]
