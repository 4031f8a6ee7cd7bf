"""Wire models shared by the dispatcher and the worker: the contract in docs/api.md.

Field names and status words here are the compatibility surface with existing frontends; do not
rename them. Unknown request fields are ignored (``GenerateRequest``'s are reported).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PlainSerializer,
    PrivateAttr,
    field_validator,
    model_validator,
)

from songserve.body_fields import BodyFields, read_body

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
    error_kind: ErrorKind | None = None  # always None on success; the field is shared with error bodies


def _whole_as_int(value: float) -> int | float:
    return int(value) if value.is_integer() else value


# A percent reads as a float (the reference may send one); ours are whole and go out as ints, as they always did.
Percent = Annotated[float, PlainSerializer(_whole_as_int)]


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
    checkpoint_layout: str | None = None  # what was found where ("own", "release")
    checkpoints: dict[str, str] = Field(default_factory=dict)  # each file or folder it loaded, by role
    architectures: dict[str, dict[str, Any]] = Field(default_factory=dict)  # per backbone: layers, hidden, …
    version: str | None = None
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


class WorkerAnnouncement(BaseModel):
    """Worker → dispatcher ``POST /workers``: "call me at ``url``"; repeating it renews the registration.

    The URL is where the dispatcher sends ``/health``, ``/generate`` and the rest, so it is a plain
    origin (scheme, host, port): a path or query would be dropped or mangled when routes are appended.
    """

    model_config = ConfigDict(extra="ignore")

    url: str = Field(
        max_length=200, description="the worker's base URL as the dispatcher should call it: http(s)://host[:port]"
    )
    ttl_sec: float = Field(
        15.0,
        ge=1.0,
        le=3600.0,
        allow_inf_nan=False,
        description="seconds the registration lasts unless renewed (workers send 3 × their announce interval)",
    )

    @field_validator("url")
    @classmethod
    def _plain_origin(cls, value: str) -> str:
        """http(s)://host[:port] with nothing after it (a trailing ``/`` is dropped); else a one-line reason."""
        try:
            parts = urlsplit(value)
            parts.port  # noqa: B018  (raises on a port that is not a number in 0..65535)
        except ValueError as exc:
            raise ValueError(f"{value!r} is not a valid URL ({exc})") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{value!r} is not an http(s) URL with a host")
        if parts.username is not None or parts.password is not None:
            raise ValueError(f"{value!r} carries credentials; the worker token is sent as a header instead")
        if parts.path not in ("", "/") or parts.query or parts.fragment or value.endswith(("?", "#")):
            raise ValueError(f"{value!r} has a path, query or fragment; give only http(s)://host[:port]")
        if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in value):
            raise ValueError(f"{value!r} contains whitespace or control characters")
        return value.rstrip("/")


class WorkerAnnounced(BaseModel):
    """Dispatcher → worker answer to ``POST /workers``: the registration and how long it lasts."""

    worker_id: int = Field(ge=0, description="the dispatcher's id for this worker; the same on every renewal")
    expires_in_sec: float = Field(ge=0, description="seconds until the registration lapses unless renewed")


# ---- dispatcher ---------------------------------------------------------------------------------


class GenerateRequest(BaseModel):
    """``POST /generate``, parsed the way the reference backend parses it.

    The reference's fields (``mode`` … ``temperature``) have its types and its lax parsing: numeric strings
    and whole floats are coerced (``"3"``, ``3.0``), any string is a valid ``mode`` or ``prompt_mode``, any
    length of ``tags`` and ``prompt``. Their ranges are applied afterwards by ``songserve.api.requests.normalize``
    (clamped as the reference does, or 422 in strict mode), which also reports every change and unknown name;
    for that it needs the values as sent and the unknown names, kept in ``body``. ``duration`` is a float:
    fractions of a minute are our extension. Our extensions keep their own ranges here (422 naming the field).
    """

    model_config = ConfigDict(extra="ignore")  # unknown names are kept only in ``body``, bounded

    mode: str = Field("vocal", description="instrumental, or anything else = vocal")
    prompt_mode: str = Field("tags", description="tags, or anything else = natural")
    prompt: str = Field("", description="natural-language style prompt (any length; the prompt builder shortens)")
    tags: str = Field("", description="comma-separated tags (any length; the prompt builder shortens)")
    lyrics: str = Field("", max_length=50_000, description="≤ 10,000 characters after cleaning")
    duration: float = Field(3.0, allow_inf_nan=False, description="minutes; out of range is clamped")
    top_k_bb: int = Field(80, description="backbone top-k; clamped into 1–200")
    temperature: float = Field(1.0, allow_inf_nan=False, description="backbone temperature; clamped into 0.6–1.4")
    num_tracks: int = Field(2, ge=1)
    seed: int | None = Field(None, ge=0, le=2**31 - 1)
    top_k_sr: int = Field(10, ge=1, le=1024)
    backbone: str | None = None
    superres: str | None = None
    priority: int = Field(0, ge=0, le=9)

    _body: BodyFields = PrivateAttr(default_factory=BodyFields)

    @model_validator(mode="wrap")
    @classmethod
    def _keep_sent_values(cls, data: Any, handler: ModelWrapValidatorHandler[GenerateRequest]) -> GenerateRequest:
        model = handler(data)
        model._body = read_body(data, cls.model_fields)
        return model

    @property
    def body(self) -> BodyFields:
        """The declared fields present in the body as sent (before coercion), and its unknown names, bounded."""
        return self._body


class GenerateAccepted(BaseModel):
    status: Literal["accepted", "queued"]
    job_id: str
    num_tracks: int
    queue_position: int
    adjusted: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description='(extension) values read differently from how they were sent: {"field": {"from", "to"}}',
    )
    ignored: list[str] = Field(default_factory=list, description="(extension) unknown field names, not used (≤ 32)")
    notes: list[str] = Field(default_factory=list, description="(extension) what else to know: typos, defaults")


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
