"""Wire models of the dispatcher's client routes: ``POST /generate``, its answer, and the job view.

Field names and status words here are the compatibility surface with existing frontends (the
reference backend's); do not rename them. Unknown request fields are ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ModelWrapValidatorHandler, PrivateAttr, model_validator


class GenerateRequest(BaseModel):
    """``POST /generate``, parsed the way the reference backend parses it.

    The reference's fields (``mode`` … ``temperature``) have its types and its lax parsing: numeric
    strings and whole floats are coerced (``"3"``, ``3.0``), any string is a valid ``mode`` or
    ``prompt_mode``, any length of ``tags`` and ``prompt``. Their ranges are applied afterwards by
    ``songserve.api.requests.normalize`` (clamped as the reference does, or 422 in strict mode),
    which also reports every change; for that it needs the values as sent, kept in ``sent``.
    ``duration`` is a float: fractions of a minute are our extension. Our extensions keep their own
    ranges here (422 naming the field).
    """

    model_config = ConfigDict(extra="allow")

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

    _sent: dict[str, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _keep_sent_values(cls, data: Any, handler: ModelWrapValidatorHandler[GenerateRequest]) -> GenerateRequest:
        model = handler(data)
        if isinstance(data, dict):
            model._sent = {k: data[k] for k in cls.model_fields if k in data}
        return model

    @property
    def sent(self) -> dict[str, Any]:
        """The declared fields present in the body, as sent (before coercion)."""
        return self._sent


class GenerateAccepted(BaseModel):
    status: Literal["accepted", "queued"]
    job_id: str
    num_tracks: int
    queue_position: int
    adjusted: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description='(extension) values read differently from how they were sent: {"field": {"from", "to"}}',
    )


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
