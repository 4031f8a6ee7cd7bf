"""Wire models between a dispatcher and a worker: ``/generate``, ``/health``, ``/config``, tasks, batches.

Our worker speaks the reference worker's API (its field names and status words) and adds fields
of its own, each optional, so the reference's dispatcher reads our answers and ours reads the
reference's (docs/api.md, "Worker").
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from songserve.schemas.common import (
    ADAPTER_PATTERN,
    FILE_NAME_PATTERN,
    ID_PATTERN,
    MAX_ADAPTER_SCALE,
    MAX_SEED,
    NO_CONTROL,
    SHA256_PATTERN,
    WORD_PATTERN,
    Percent,
)
from songserve.schemas.continuation import PrefixCodes


class WorkerPhase(StrEnum):
    idle = "idle"
    loading_backbone = "loading_backbone"
    backbone = "backbone"
    loading_superres = "loading_superres"
    superres = "superres"
    loading_decoder = "loading_decoder"
    decoding = "decoding"
    loading_encoder = "loading_encoder"  # an upload's audio (POST /encode)
    encoding = "encoding"


class WorkerStatus(StrEnum):
    initializing = "initializing"
    idle = "idle"
    busy = "busy"
    error = "error"  # the model thread died or loading failed
    stalled = "stalled"  # a task made no progress past its deadline


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
    tags: str = Field("", max_length=50_000)  # the dispatcher accepts any length; the prompt builder shortens
    description: str = Field("", max_length=50_000)
    duration: float = Field(0.5, gt=0, le=15, description="minutes")
    lyrics: str = Field("", max_length=20000)
    backbone_name: str = Field("", max_length=200, pattern=NO_CONTROL)
    superres_name: str = Field("", max_length=200, pattern=NO_CONTROL)
    top_k_bb: int = Field(80, ge=1, le=1024)
    top_k_sr: int = Field(10, ge=1, le=1024)
    temperature: float = Field(1.0, gt=0, le=5)
    superres_text_mode: str = Field("default", max_length=32, pattern=WORD_PATTERN)
    raw_user_input: str = Field("", max_length=50_000)
    raw_mode: str = Field("vocal", max_length=32, pattern=WORD_PATTERN)
    raw_prompt_mode: str = Field("tags", max_length=32, pattern=WORD_PATTERN)
    seed_override: int | None = Field(None, ge=0, le=MAX_SEED)
    task_id: str = Field("", max_length=64, pattern=ID_PATTERN)
    job_id: str = Field("", max_length=64, pattern=ID_PATTERN)
    track_index: int = Field(0, ge=0, le=1000)
    prefix: PrefixCodes | None = None  # ext: continue from these frames (kept exactly), generate the rest
    adapter: str = Field("", max_length=64, pattern=r"^$|" + ADAPTER_PATTERN)  # ext: a LoRA adapter by name; "" none
    adapter_scale: float = Field(1.0, ge=0, le=MAX_ADAPTER_SCALE, allow_inf_nan=False)  # ext: 0 = the base model
    preview: bool = False  # ext: live audio from the first seconds, whether or not anyone listens yet


class ResultFile(BaseModel):
    """What a worker wrote into one result file, so the dispatcher can check the copy it makes."""

    model_config = ConfigDict(extra="ignore")

    bytes: int = Field(ge=0)
    sha256: str = Field(pattern=SHA256_PATTERN)  # lower-case hex


class WorkerGenerateResult(BaseModel):
    """Worker → dispatcher: a finished track. ``task_id``, ``json_filename``, ``codes_filename`` and ``files`` are ours.

    ``files``: each file's size and checksum by its file name (the reference's worker sends none:
    the dispatcher then checks what a WAV's header and ``duration_sec`` allow).
    """

    model_config = ConfigDict(extra="ignore")

    status: Literal["ok"] = "ok"
    task_id: str = ""
    mp3_filename: str = Field(min_length=1, pattern=FILE_NAME_PATTERN)
    wav_filename: str = Field(min_length=1, pattern=FILE_NAME_PATTERN)
    json_filename: str = Field("", pattern=FILE_NAME_PATTERN)
    codes_filename: str = Field("", pattern=FILE_NAME_PATTERN)  # ext: the take's code grid (songserve/audio/codes.py)
    duration_sec: float
    backbone_tokens: int
    gpu_id: int
    seed: int
    metadata: dict[str, Any] = {}
    files: dict[str, ResultFile] = Field(default_factory=dict, max_length=8)
    error_kind: ErrorKind | None = None  # always None on success; the field is shared with error bodies


class TakeHealth(BaseModel):
    """One take of the batch a worker runs (``/health``'s ``tasks``), with its own progress."""

    model_config = ConfigDict(extra="allow")

    task_id: str
    phase: str = "idle"
    progress: Percent = 0
    progress_detail: str = ""
    tokens_per_sec: float | None = None
    cancelled: bool = False
    last_progress_at: float | None = None  # wall clock of the take's last report
    live: str | None = None  # its live audio's state (pipeline/live.py's LiveState), once wanted
    preview_sec: float | None = None  # seconds of its live audio written so far


class AdapterHeld(BaseModel):
    """A LoRA adapter a worker holds in one of its slots."""

    model_config = ConfigDict(extra="ignore")

    name: str = Field(max_length=64)
    rank: int = Field(0, ge=0)
    targets: list[str] = Field(default_factory=list)
    bytes: int = Field(0, ge=0)
    hits: int = Field(0, ge=0)


class AdaptersHealth(BaseModel):
    """A worker's adapters: those resident in its slots (at most ``capacity``, ``MAX_ADAPTERS``) and every
    name it could load, of its ``ADAPTERS_DIR`` and of the uploads the dispatcher sent it (``uploaded``,
    with each one's weights' SHA-256, so a dispatcher can tell a stale copy)."""

    model_config = ConfigDict(extra="ignore")

    resident: list[AdapterHeld] = Field(default_factory=list)
    capacity: int = Field(0, ge=0)
    available: list[str] = Field(default_factory=list)
    uploaded: dict[str, str] = Field(default_factory=dict)  # the uploaded ones (of available): name → weights' sha256


class WorkerHealth(BaseModel):
    """Worker ``GET /health``: the reference's fields and our extensions (ext), all optional, in our wire order."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    status: str = "initializing"  # a WorkerStatus word
    accepting: bool = True  # ext: False while draining
    phase: str = "idle"  # a WorkerPhase word
    gpu_id: int | None = None
    seed: int | None = None
    progress: Percent = 0
    progress_detail: str = ""  # in the backbone the reference's "N/M tokens"
    tokens_per_sec: float | None = None  # ext: the backbone's rate, apart from progress_detail
    runtime_mode: str | None = None
    backbone_loaded: bool | str | None = False  # the reference worker reports the loaded model's name
    superres_loaded: bool | str | None = False
    decoder_loaded: bool | str | None = False
    encoder_loaded: bool | None = None  # ext: the codec's encoder (uploads) is in memory now
    load_sec: dict[str, float] | None = None  # ext, model pipeline: seconds of each stage's latest load
    parked: list[str] | None = None  # ext, park mode: the stages whose weights wait in host memory
    park_backbone: str | None = None  # ext, park mode: PARK_BACKBONE
    decode_step: dict[str, Any] | None = None  # ext, model pipeline: the compiled decode step, if any
    backbone_models: list[str] = Field(default_factory=list)  # ext
    superres_models: list[str] = Field(default_factory=list)  # ext
    task_id: str | None = None  # ext: the running task (the first take of a batch)
    last_progress_at: float | None = None  # ext: wall clock of its last report
    device: str | None = None  # ext
    rss_mb: float | None = None  # ext: the worker process's resident memory
    tasks_done: int | None = None  # ext
    uptime_sec: float | None = None  # ext
    error: str | None = None  # ext: why the worker is in error
    disk_free_mb: float | None = None  # ext: the output folder's disk
    disk_low: bool = False  # ext: below the worker's MIN_FREE_DISK_MB: it should get no new track
    output_files: int | None = None  # ext: files in the output folder
    batch_size: int | None = None  # ext: takes in the running batch
    tasks: list[TakeHealth] = Field(default_factory=list)  # ext: the takes of the running batch
    cuda_allocated_mb: float | None = None  # ext, on CUDA: memory torch holds on the device
    kv_snapshots: dict[str, Any] | None = None  # ext, model pipeline: the backbone's kept prefixes (slots, bytes)
    kept_audio: dict[str, Any] | None = None  # ext, model pipeline: latest takes' decoded audio (origins, bytes)
    adapters: AdaptersHealth | None = None  # ext, model pipeline: the LoRA adapters it can load and holds
    launch_nonce: str | None = None  # ext: the id run_backend.sh gave this process (LAUNCH_NONCE), if any

    def take(self, task_id: str) -> TakeHealth | None:
        """The progress of one running take: its own entry, or the whole worker's for a single task."""
        for t in self.tasks:
            if t.task_id == task_id:
                return t
        if self.task_id == task_id:
            return TakeHealth(
                task_id=task_id,
                phase=self.phase,
                progress=self.progress,
                progress_detail=self.progress_detail,
                tokens_per_sec=self.tokens_per_sec,
            )
        return None

    @property
    def kind(self) -> str:
        """``songserve`` for our workers (their health always carries ``task_id``), else ``reference``."""
        return "songserve" if "task_id" in self.model_fields_set else "reference"


class WorkerConfig(BaseModel):
    """Worker ``GET /config``: the reference's first five fields, then our extensions, in our wire order."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    backbone_models: list[str] = Field(default_factory=list)
    superres_models: list[str] = Field(default_factory=list)
    runtime_mode: str | None = None
    genre_options: list[str] = Field(default_factory=list)
    language_options: list[str] = Field(default_factory=list)
    sample_rate: int | None = None  # Hz of the audio it writes
    frame_rate: float | None = None  # codec frames per second
    channels: int | None = None
    formats: list[str] = Field(default_factory=list)  # the files each track gets besides its JSON
    device: str | None = None
    tiny_checkpoints: bool = False
    # ext: seeded random weights (any set pipeline/tiny/ built, its MANIFEST.json says so): the audio is noise
    # of the right length; the dispatcher's /config counts such workers (untrained_workers) for the page's banner
    untrained: bool = False
    encoder: bool = False  # ext: it encodes a person's audio into codes (POST /encode)
    checkpoint_layout: str | None = None  # what was found where ("own", "release")
    checkpoints: dict[str, str] = Field(default_factory=dict)  # each file or folder it loaded, by role
    architectures: dict[str, dict[str, Any]] = Field(default_factory=dict)  # per backbone: layers, hidden, …
    version: str | None = None
    # ext: the most parts of one repaint it writes (``PrefixCodes.parts``); 1: an older worker of ours, which
    # reads ``repaint`` alone and would write only the first part
    repaint_parts: int = Field(1, ge=1)
    announce: list[dict[str, Any]] = Field(default_factory=list)  # ANNOUNCE: each dispatcher and where it stands
    # limits for the dispatcher: refuse what cannot fit, pack takes up to max_batch
    max_new_tokens: int | None = None  # the backbone's token budget (MAX_NEW_TOKENS)
    max_batch: int = 1  # takes of one request it runs as one batch (POST /generate_batch); 1 = /generate only
    eoa_min_share: float | None = None  # share of the requested length before end-of-audio is accepted
    tokens_per_minute: int | None = None  # audio tokens per minute of song (21.53 frames/s × 2 × 60)
    backbones: dict[str, dict[str, int]] = Field(default_factory=dict)  # per backbone: the four limits below
    max_sequence_length: int | None = None  # the backbone's context, in tokens (prompt + audio)
    max_prompt_length: int | None = None  # tokens of prompt the backbone takes
    kv_bytes_per_take: int | None = None  # KV-cache bytes one take needs at full context
    superres_max_prompt_length: int | None = None


class WorkerTakeFailure(BaseModel):
    """A take that did not finish (a ``/generate_batch`` result; ``/generate``'s answer when cancelled)."""

    status: Literal["cancelled", "error"]
    task_id: str
    error: str


class WorkerBatchRequest(BaseModel):
    """Dispatcher → worker ``POST /generate_batch``: takes of one request that differ only in seed and ids."""

    model_config = ConfigDict(extra="ignore")

    takes: list[WorkerGenerateRequest] = Field(min_length=1, max_length=64)


class WorkerBatchResult(BaseModel):
    """Worker ``POST /generate_batch``: per take, in the order of ``takes``, its result or why it has none."""

    status: Literal["ok"] = "ok"  # the batch ran (a batch refused as a whole is an error body instead)
    results: list[Annotated[WorkerGenerateResult | WorkerTakeFailure, Field(discriminator="status")]]


class TaskState(StrEnum):
    running = "running"
    done = "done"  # the same word as a track's (the worker's /generate answer keeps the reference's "ok")
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
