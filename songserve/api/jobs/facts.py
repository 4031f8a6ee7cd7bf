"""What the dispatcher tells the job service about a job and about the fleet: plain records."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from songserve.api.jobs.records import Key


@dataclass(frozen=True)
class JobFacts:
    """What a job's view needs from the dispatcher besides the job."""

    positions: Mapping[Key, int]  # 1-based queue positions of the queued tracks (of every job)
    eta: float | None  # seconds until the job's last track is done (None: finished elsewhere, or no history)
    waiting: Waiting = field(default_factory=lambda: Waiting())  # why the queued tracks have not started


@dataclass(frozen=True)
class Waiting:
    """Why queued tracks have not started, as the last dispatch pass found: each planned track's reason
    (``placement.plan``'s), and for the rest the pass's own (every worker busy: no plan was made)."""

    reasons: Mapping[Key, str] = field(default_factory=dict)
    otherwise: str | None = None  # None: not planned yet

    def of(self, key: Key) -> str | None:
        return self.reasons.get(key, self.otherwise)


@dataclass(frozen=True)
class Fleet:
    """What the workers offer, as they said in their ``/config`` (or health)."""

    backbone_models: list[str]
    superres_models: list[str]
    context: tuple[int, int] | None  # (the longest backbone context in tokens, audio tokens per minute)
    workers: int
    untrained: int = 0  # workers running an untrained set (their /config says so): what they make is noise
    on_cpu: int = 0  # workers whose /config names the CPU as their device: minutes of song take them minutes
    adapters: list[AdapterOffer] = field(default_factory=list)  # the LoRA adapters some worker can load, by name


@dataclass(frozen=True)
class AdapterOffer:
    """A LoRA adapter as the fleet offers it: which workers can load it, which hold it now, and what it
    is (rank, the layers it targets, its size) as a worker that holds it says."""

    name: str
    workers: list[int]
    resident_on: list[int]
    rank: int | None = None
    targets: list[str] = field(default_factory=list)
    bytes: int | None = None
    uploaded: bool = False  # a key's upload (some worker lists it among its uploads), not a worker's own folder's
