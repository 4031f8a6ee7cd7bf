"""Wire models of a person's own audio: the dispatcher's ``/uploads`` routes, and a worker's ``POST /encode``.

An upload is a file a client sends to continue from (docs/api.md, "Uploads"): stored, then encoded
into the codec's code grid by a worker (``queued → encoding → ready | failed``), then continued with
``continue_from: {"upload_id": …}``. The worker receives the file's bytes as they were uploaded (it
reads them with ``songserve/audio/reading.py``, as the dispatcher did to check them) and answers the grid
as a ``PrefixCodes``: the same shape a retake's kept frames travel in.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from songserve.schemas.continuation import PrefixCodes


class UploadStatus(StrEnum):
    queued = "queued"  # stored, waiting for a worker
    encoding = "encoding"  # a worker is turning it into codes
    ready = "ready"  # its codes are stored: it can be continued
    failed = "failed"  # it could not be encoded (``error`` says why)

    @property
    def terminal(self) -> bool:
        return self in (UploadStatus.ready, UploadStatus.failed)


class UploadView(BaseModel):
    """``POST /uploads``'s answer and ``GET /uploads/{id}``."""

    upload_id: str
    status: UploadStatus
    duration_sec: float = Field(description="seconds of audio, at 44.1 kHz")
    frames: int = Field(description="code frames it gives (21.53 a second); the worker's own count once ready")
    error: str | None = None
    filename: str = ""  # the client's name for it, shown only
    source: dict[str, Any] = Field(default_factory=dict, description="format, subtype, sample_rate, channels, frames")
    created_at: float
    finished_at: float | None = None
    attempts: int = 0
    codes: str | None = Field(None, description="GET this for its code grid once ready (the .codes format)")


class WorkerEncodeResult(BaseModel):
    """Worker → dispatcher: ``POST /encode``'s answer, the audio's code grid."""

    model_config = ConfigDict(extra="ignore")

    status: Literal["ok"] = "ok"
    task_id: str = ""
    grid: PrefixCodes  # levels × frames int16, level-major, base64
    frame_rate: float = Field(gt=0)
    hop: int = Field(gt=0)
    sample_rate: int = Field(gt=0)
    duration_sec: float = Field(ge=0)
    source: dict[str, Any] = Field(default_factory=dict, max_length=16)
    timings: dict[str, float] = Field(default_factory=dict, max_length=16)


class AdapterView(BaseModel):
    """``POST /adapters``' and ``DELETE /adapters/{name}``'s answer: an uploaded LoRA adapter."""

    name: str
    uploaded: bool = True
    owner: str | None = Field(description="the name of the API key that uploaded it; null without keys")
    rank: int
    targets: list[str]
    bytes: int = Field(description="both files")
    sha256: str = Field(description="of adapter_model.safetensors")
    created_at: float
    workers: list[int] = Field(default_factory=list, description="workers that hold it now")
