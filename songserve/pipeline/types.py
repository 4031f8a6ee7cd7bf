"""Typed seams between the stages and the request they serve, and the ``Pipeline`` the worker drives.

torch is imported for type checking only: the test tone pipeline and the worker's runtime read
this module, and a tone worker must start without loading torch (it needs none).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any, Protocol

from songserve.pipeline.context import TaskContext

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Repaint:
    """The part of a ``Prefix`` grid a take writes anew: from frame ``start``, rejoining the grid at a
    frame within ``window`` of ``end`` (the join), the grid's frames before ``start`` and from the
    join on kept exactly."""

    start: int
    end: int
    window: int = 0
    opening: int = 0  # > 0: the grid's first frames are room for a new opening (start 0, the join at or after them)


@dataclass(frozen=True)
class Prefix:
    """A code grid to continue from: the take starts with exactly these frames, every level of them.

    Where it came from (a finished take, later a user's own audio through the codec's encoder) is
    the sender's business; ``origin`` only labels it in the worker's KV snapshots and metadata."""

    raw: bytes = field(repr=False)  # levels × frames int16, little-endian, level-major
    levels: int
    frames: int
    origin: str = ""
    repaint: Repaint | None = None  # None: keep every frame and generate after them
    parts: tuple[Repaint, ...] = ()  # a repaint's parts in order (the first is ``repaint``); () reads as (repaint,)

    def repaints(self) -> tuple[Repaint, ...]:
        """Every part written anew, in order: the parts, or the one repaint, or none (a retake)."""
        if self.parts:
            return self.parts
        return (self.repaint,) if self.repaint is not None else ()


@dataclass(frozen=True)
class TrackRequest:
    """One track, as the worker receives it (docs/api.md, worker payload)."""

    lyrics: str = ""
    duration: float = 0.5  # minutes
    genre: str = ""
    language: str = ""
    tags: str = ""
    description: str = ""
    instrumental: bool = False
    backbone_name: str = ""
    superres_name: str = ""
    top_k_bb: int = 80
    top_k_sr: int = 10
    temperature: float = 1.0
    superres_text_mode: str = "default"
    seed: int = 0
    task_id: str = ""
    job_id: str = ""
    track_index: int = 0
    extra: dict[str, Any] = field(default_factory=dict[str, Any])  # raw_* fields, recorded in the JSON only
    prefix: Prefix | None = None  # continue from these frames (a retake); None: a take from the prompt alone
    preview: bool = False  # live audio from the first seconds, listened to or not (``pipeline/live.py``)
    adapter: str = ""  # a LoRA adapter of ADAPTERS_DIR by name ("" none), for the backbone and super-resolution
    adapter_scale: float = 1.0  # its low-rank delta times this (0: the base model exactly)


@dataclass
class BackboneResult:
    codes: torch.Tensor  # (2, frames): q0 and q1 codes in [0, 1024), a prefix's kept frames first
    prompt_tokens: int
    new_tokens: int  # sampled here (a prefix's kept tokens are not)
    stopped_by: str  # "end_of_audio" or "budget"
    prefill: dict[str, Any] = field(default_factory=dict[str, Any])  # tokens, restored (from a KV snapshot), sec


@dataclass
class TrackResult:
    wav_filename: str
    mp3_filename: str
    json_filename: str
    duration_sec: float
    backbone_tokens: int
    seed: int
    metadata: dict[str, Any]
    codes_filename: str = ""  # the take's code grid (songserve/audio/codes.py), beside its WAV


@dataclass
class EncodeResult:
    """A person's audio as the codec's code grid (``Pipeline.encode``)."""

    codes: Any  # numpy (levels, frames) int16, in [0, 1024)
    frame_rate: float
    hop: int  # samples per frame
    sample_rate: int
    timings: dict[str, float] = field(default_factory=dict[str, float])


class Pipeline(Protocol):
    """What the worker's runtime drives: the model pipeline or the test tone pipeline.

    Every method and attribute the worker uses is named here, so the worker holds a ``Pipeline``
    and never asks which one it has. All of them but ``phase_hook`` and the three reports run on
    the worker's single model thread.
    """

    phase_hook: Callable[[str], None]  # the runtime's: loading phases show in /health

    def load(self) -> None:
        """Load what stays resident; raise ``ConfigError`` (one line) when it cannot work."""
        ...

    def run(self, req: TrackRequest, ctx: TaskContext) -> TrackResult:
        """One take; raises what ended it (``TaskCancelled``, ``RequestError``, anything else)."""
        ...

    def run_batch(self, reqs: list[TrackRequest], ctxs: list[TaskContext]) -> list[TrackResult | BaseException]:
        """Takes of one request: per take its result or the exception that ended it; a request
        error that concerns them all (an unknown model, takes that differ) raises instead."""
        ...

    def prefetch_adapters(self, names: list[str]) -> None:
        """Load the named LoRA adapters ahead of their takes; called off the model thread (the
        worker's request handler). A failure is left for the takes to report."""
        ...

    def upload_adapter(self, name: str, config: IO[bytes], weights: IO[bytes]) -> dict[str, Any]:
        """Check an uploaded adapter's two files against the models (``residency.AdapterStore.upload``)
        and keep it as ``name``; off the model thread. Its description (rank, targets, sha256)."""
        ...

    def remove_adapter(self, name: str, sha256: str | None = None) -> None:
        """Remove uploaded adapter ``name`` (``NotFoundError`` when there is none); with ``sha256``, only
        the copy of that digest (``ConflictError`` when the worker holds another)."""
        ...

    def encode(self, audio: Any, ctx: TaskContext) -> EncodeResult:
        """44.1 kHz stereo samples (numpy (2, n) float32 in [-1, 1], ``songserve/audio/reading.py``) as the
        codec's code grid; raises ``UnavailableError`` when this pipeline has no encoder."""
        ...

    def loaded(self) -> dict[str, Any]:
        """``/health``'s pipeline fields: ``backbone_loaded``, ``superres_loaded``, ``decoder_loaded``, ``encoder_loaded``,
        and the model pipeline's own (``load_sec``, ``parked``, ``park_backbone``, ``decode_step``)."""
        ...

    def describe(self) -> dict[str, Any]:
        """``/config``'s pipeline fields: ``backbone_models``, ``superres_models``, ``sample_rate``,
        ``frame_rate``, ``encoder`` (whether ``encode`` works), and where known ``channels`` and the
        checkpoint set's fields."""
        ...

    def limits(self) -> dict[str, Any]:
        """``/config``'s limits for the dispatcher (``WorkerConfig``): at least ``max_batch``."""
        ...
