"""Typed seams between the stages and the request they serve."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from songserve.pipeline.context import TaskContext


@dataclass(frozen=True)
class TrackRequest:
    """One track, as the worker receives it (shared/docs/api.md, worker payload)."""

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


@dataclass
class BackboneResult:
    codes: torch.Tensor  # (2, frames): q0 and q1 codes in [0, 1024)
    prompt_tokens: int
    new_tokens: int
    stopped_by: str  # "end_of_audio" or "budget"


@dataclass
class TrackResult:
    wav_filename: str
    mp3_filename: str
    json_filename: str
    duration_sec: float
    backbone_tokens: int
    seed: int
    metadata: dict[str, Any]


class Pipeline(Protocol):
    """What the worker's runtime drives: the model pipeline or the test tone pipeline."""

    phase_hook: Callable[[str], None]  # the runtime's: loading phases show in /health

    def load(self) -> None: ...

    def run(self, req: TrackRequest, ctx: TaskContext) -> TrackResult: ...

    def loaded(self) -> dict[str, bool]: ...

    def describe(self) -> dict[str, Any]: ...
