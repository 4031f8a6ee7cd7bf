"""Wire models of the dispatcher's client routes: ``POST /generate``, its answer, and the job view.

Field names and status words here are the compatibility surface with existing frontends (the
reference backend's); do not rename them. Unknown request fields are ignored (``GenerateRequest``'s are
reported, bounded: ``songserve/schemas/body_fields.py``).
"""

from __future__ import annotations

from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from songserve.schemas.body_fields import BodyFields, read_body
from songserve.schemas.common import ADAPTER_PATTERN, MAX_ADAPTER_SCALE
from songserve.schemas.continuation import ContinueFrom

WebhookEventName = Literal["start", "progress", "track", "completed"]
MAX_WAIT_SEC = 60  # the longest a client may ask to wait for a job's end: ``Prefer: wait=N``, MCP's wait_for_job


class AceStepExtras(BaseModel):
    """What ACE-Step's dialect (``songserve/api/acestep``) needs later of a job it submitted."""

    model_config = ConfigDict(extra="ignore")

    audio_format: Literal["mp3", "wav", "flac"] = "mp3"
    caption: str = Field("", max_length=50_000)


class TakeChoice(BaseModel):
    """One take's own choices in ``GenerateRequest.takes``: its LoRA adapter and the adapter's scale."""

    model_config = ConfigDict(extra="forbid")

    adapter: str | None = Field(None, max_length=64, pattern=ADAPTER_PATTERN, description="null: the base model")
    adapter_scale: float = Field(1.0, ge=0, le=MAX_ADAPTER_SCALE, allow_inf_nan=False)


class GenerateRequest(BaseModel):
    """``POST /generate``, parsed the way the reference backend parses it.

    The reference's fields (``mode`` … ``temperature``) have its types and its lax parsing: numeric strings
    and whole floats are coerced (``"3"``, ``3.0``), any string is a valid ``mode`` or ``prompt_mode``, any
    length of ``tags`` and ``prompt``. Their ranges are applied afterwards by ``songserve.api.service.requests.normalize``
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
    duration: float = Field(
        3.0, allow_inf_nan=False, description="minutes; out of range is clamped (refused: STRICT_REQUESTS, MCP)"
    )
    top_k_bb: int = Field(80, description="backbone top-k; clamped into 1–200 (refused: STRICT_REQUESTS, MCP)")
    temperature: float = Field(
        1.0,
        allow_inf_nan=False,
        description="backbone temperature; clamped into 0.6–1.4 (refused: STRICT_REQUESTS, MCP)",
    )
    num_tracks: int = Field(2, ge=1, description="takes of the song, made in parallel (at most MAX_TRACKS)")
    seed: int | None = Field(
        None, ge=0, le=2**31 - 1, description="seed of take 0 (take i uses seed + i); left out: the dispatcher picks"
    )
    top_k_sr: int = Field(10, ge=1, le=1024)
    backbone: str | None = None
    superres: str | None = None
    priority: int = Field(0, ge=0, le=9)
    acestep: AceStepExtras | None = Field(
        None, description="(internal) what the ACE-Step dialect keeps with a job it made; our clients leave it out"
    )
    continue_from: ContinueFrom | None = Field(
        None, description="keep a finished take's audio before at_sec and generate the rest (docs/api.md)"
    )
    preview: bool = Field(
        False, description="make live audio from the first seconds, listened to or not (a listener asks for it too)"
    )
    adapter: str | None = Field(
        None,
        max_length=64,
        pattern=ADAPTER_PATTERN,
        description="a LoRA adapter (GET /adapters) for every take; left out: the base model (a retake: the take's)",
    )
    adapter_scale: float = Field(
        1.0, ge=0, le=MAX_ADAPTER_SCALE, allow_inf_nan=False, description="the adapter's strength; 0 is the base model"
    )
    takes: list[TakeChoice] | None = Field(
        None,
        max_length=1000,
        description="each take's own adapter and scale, one entry per take (as many as num_tracks)",
    )

    webhook: str | None = Field(
        None, max_length=2000, description="an http(s) URL that receives the job's events, signed (docs/api.md)"
    )
    webhook_events: list[WebhookEventName] | None = Field(
        None, min_length=1, max_length=8, description="which events the webhook receives; default [completed]"
    )

    _body: BodyFields = PrivateAttr(default_factory=BodyFields)

    @field_validator("webhook")
    @classmethod
    def _webhook_url(cls, value: str | None) -> str | None:
        """The URL's form; where it may point is the dispatcher's to check (``WEBHOOK_ALLOW``)."""
        if value is None:
            return None
        parts = urlsplit(value.strip())
        try:
            parts.port  # noqa: B018  # raises for a port that is not a number in range
        except ValueError:
            raise ValueError("has a port that is not a number from 0 to 65535") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http:// or https:// URL with a host")
        if parts.username is not None or parts.password is not None:
            raise ValueError("must not carry a user or password (the events are signed instead)")
        return value.strip()

    @field_validator("webhook_events")
    @classmethod
    def _webhook_events(cls, value: list[str] | None, info: ValidationInfo) -> list[str] | None:
        if value is not None and not info.data.get("webhook"):
            raise ValueError("needs a webhook to send them to")
        return list(dict.fromkeys(value)) if value is not None else None

    @model_validator(mode="after")
    def _one_choice_per_take(self) -> GenerateRequest:
        if self.takes is not None and len(self.takes) != self.num_tracks:
            raise ValueError(f"takes has {len(self.takes)} entries for {self.num_tracks} takes (num_tracks)")
        return self

    def take_adapter(self, index: int) -> tuple[str, float]:
        """The adapter (``""`` none) and scale take ``index`` is made with."""
        if self.takes is not None and index < len(self.takes):
            choice = self.takes[index]
            return choice.adapter or "", choice.adapter_scale
        return self.adapter or "", self.adapter_scale

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


class KeyLimits(BaseModel):
    """An API key's limits (``API_KEYS_FILE``); None is unlimited, a permission is off unless given."""

    model_config = ConfigDict(extra="forbid")

    tracks_per_hour: int | None = Field(None, ge=0, description="tracks submitted in any hour")
    concurrent_jobs: int | None = Field(None, ge=0, description="jobs not yet finished at once")
    max_duration: float | None = Field(None, gt=0, description="longest song, in minutes")
    max_priority: int | None = Field(None, ge=0, le=9, description="highest priority")
    upload_adapters: bool = Field(
        False, description="may upload LoRA adapters (POST /adapters); API_KEY and a dispatcher without keys may"
    )


class UsageView(BaseModel):
    """``GET /usage``: the caller's key, its limits and its use (counted from the job store)."""

    name: str | None = Field(description="the key's name; null without keys")
    limits: KeyLimits
    tracks_last_hour: int
    active_jobs: int
    tracks_left: int | None = Field(description="tracks it may still submit this hour; null: unlimited")
    jobs_left: int | None = Field(description="jobs it may still start now; null: unlimited")
    next_track_in_sec: float = Field(description="seconds until one more track fits the hourly limit (0: now)")


class TrackFiles(BaseModel):
    mp3: str
    wav: str
    codes: str | None = None  # the take's code grid (GET /job/{id}/track/{i}/codes), when its worker kept one


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
    waiting: str | None = None  # (extension) why a queued track has not started yet, as the last dispatch pass found
    files: TrackFiles | None = None
    metadata: dict[str, Any] = {}
    preview_sec: float = 0.0  # (extension) seconds of live audio a listener can hear now
    stream_url: str | None = None  # (extension) its live audio while it is made, then the final audio


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


class JobAsked(BaseModel):
    """What a listed job was asked for, as served (``GET /jobs``): enough for a page to name it again."""

    mode: str
    prompt_mode: str
    prompt: str
    tags: str
    duration: float = Field(description="minutes")
    continue_from: ContinueFrom | None = None


class JobListItem(JobView):
    """A job of ``GET /jobs``: its view (``GET /job/{id}``'s body) and what it was asked for."""

    asked: JobAsked


class JobList(BaseModel):
    """``GET /jobs``: the caller's jobs, newest first, one page of them."""

    jobs: list[JobListItem]
    next_cursor: str | None = Field(description="send as cursor for the next page, older jobs; null: no more")
