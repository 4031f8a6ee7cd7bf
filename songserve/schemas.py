"""Wire models shared by the dispatcher and the worker: the contract in shared/docs/api.md.

Field names and status words here are the compatibility surface with existing frontends; do not
rename them. Unknown request fields are ignored.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

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


class WorkerGenerateRequest(BaseModel):
    """Dispatcher → worker ``POST /generate``."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    genre: str = ""
    language: str = ""
    tags: str = ""
    description: str = ""
    duration: float = Field(0.5, gt=0, le=15, description="minutes")
    lyrics: str = Field("", max_length=20000)
    backbone_name: str = ""
    superres_name: str = ""
    top_k_bb: int = Field(80, ge=1, le=1024)
    top_k_sr: int = Field(10, ge=1, le=1024)
    temperature: float = Field(1.0, gt=0, le=5)
    superres_text_mode: str = "default"
    raw_user_input: str = ""
    raw_mode: str = "vocal"
    raw_prompt_mode: str = "tags"
    seed_override: int | None = Field(None, ge=0)
    task_id: str = Field("", max_length=64, pattern=r"^[A-Za-z0-9_.-]*$")
    job_id: str = Field("", max_length=64)
    track_index: int = Field(0, ge=0)


class WorkerGenerateResult(BaseModel):
    """Worker → dispatcher: a finished track. ``task_id`` and ``json_filename`` are our extensions."""

    model_config = ConfigDict(extra="ignore")

    status: Literal["ok"] = "ok"
    task_id: str = ""
    mp3_filename: str
    wav_filename: str
    json_filename: str = ""
    duration_sec: float
    backbone_tokens: int
    gpu_id: int
    seed: int
    metadata: dict[str, Any] = {}


class WorkerHealth(BaseModel):
    """Worker ``GET /health``: the reference's fields, then our extensions (all optional on the wire)."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    status: str = "initializing"  # a WorkerStatus word
    phase: str = "idle"  # a WorkerPhase word
    gpu_id: int | None = None
    seed: int | None = None
    progress: float = 0
    progress_detail: str = ""
    runtime_mode: str | None = None
    backbone_loaded: bool | str | None = False  # the reference worker reports the loaded model's name
    superres_loaded: bool | str | None = False
    decoder_loaded: bool | str | None = False
    # extensions
    accepting: bool = True
    task_id: str | None = None
    backbone_models: list[str] = Field(default_factory=list)
    superres_models: list[str] = Field(default_factory=list)
    device: str | None = None
    tasks_done: int | None = None
    error: str | None = None
    disk_free_mb: float | None = None  # the output folder's disk
    disk_low: bool = False  # below the worker's MIN_FREE_DISK_MB: it should get no new track

    @property
    def kind(self) -> str:
        """``songserve`` for our workers (their health always carries ``task_id``), else ``reference``."""
        return "songserve" if "task_id" in self.model_fields_set else "reference"


class WorkerConfig(BaseModel):
    """Worker ``GET /config``: the models it offers (the reference's fields), then our extensions."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    backbone_models: list[str] = Field(default_factory=list)
    superres_models: list[str] = Field(default_factory=list)
    runtime_mode: str | None = None
    genre_options: list[str] = Field(default_factory=list)
    language_options: list[str] = Field(default_factory=list)


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
    error_kind: str | None = None  # environment, model or request
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
    metadata: dict[str, Any] = {}


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
