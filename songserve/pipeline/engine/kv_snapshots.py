"""KV snapshots: the backbone's keys and values for recent prefixes, kept so a retake prefills only the rest.

Why: a retake of a song prefills the prompt plus every kept token (about 2,600 per minute of
kept audio) before it samples anything; several retakes of the same take, or of the same point,
share that prefix. A causal model's KV for a sequence's first n positions depends on those n ids
only, so the KV of any earlier sequence that starts with the same ids is the KV of that prefix:

- lookup takes, among the snapshots of the same model, the longest common prefix with the new
  ids, and restores that many positions, never more (a snapshot longer than the new prefix is cut
  to it, and one that differs after position d gives d positions, never a position past d);
- a snapshot of exactly the new ids restores all of them and the hidden state of their last
  position (kept with the snapshot: what the first new token is sampled from), so a second retake
  of the same point prefills nothing and computes what the first one did, bit for bit; from any
  other snapshot at most ``len(ids) - 1`` positions are restored and the rest is prefilled (its
  last position's hidden state is not kept);
- slots are an LRU bounded by bytes (``KV_SNAPSHOT_MB``); a snapshot whose ids start another's
  is dropped when the longer one is saved (the longer one serves both). They live on the device,
  or with ``KV_SNAPSHOT_MEMORY=host`` in host memory (pinned on CUDA).

Keys are the model's name and the ids themselves (the prompt and the prefix's tokens), so a
different prompt, model or prefix never matches. Snapshots are taken and restored only for takes
that continue a prefix: a take from the prompt alone is computed exactly as before them. Saved
and restored on the model thread; ``describe`` runs on the event loop (``/health``), hence the lock.

Slots are compared by identity: a slot is found, moved and dropped as the object it is. (With a
dataclass's field equality, moving a slot that was not first compared the ids and KV tensors of
the slots before it, which raised, and kept raising for every later retake on that worker.) The
cache is an optimisation, so its callers treat any fault in it as a miss (``stages/backbone.py``).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from songserve.pipeline.engine.kv_cache import KVCache

log = logging.getLogger(__name__)


@dataclass(eq=False)  # a slot is itself: ``==`` on the fields would compare tensors (and raise)
class Snapshot:
    model: str
    ids: torch.Tensor  # (N,) long, on the CPU
    k: list[torch.Tensor]  # per layer (groups, N, head_dim)
    v: list[torch.Tensor]
    origin: str
    nbytes: int
    h: torch.Tensor | None = None  # (1, H): the hidden state at the last position
    used_at: float = field(default_factory=time.monotonic)
    hits: int = 0

    @property
    def tokens(self) -> int:
        return int(self.ids.shape[0])


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many leading ids two 1-D id tensors share."""
    n = min(int(a.shape[0]), int(b.shape[0]))
    if n == 0:
        return 0
    differ = (a[:n] != b[:n]).nonzero()
    return n if differ.numel() == 0 else int(differ[0, 0])


class KVSnapshots:
    """An LRU of prefixes' KV, bounded by ``capacity_bytes``."""

    def __init__(self, capacity_bytes: int, memory: str = "device") -> None:
        self.capacity = capacity_bytes
        self.memory = memory  # "device": beside the cache; "host": CPU memory (pinned on CUDA)
        self._slots: list[Snapshot] = []
        self._lock = threading.Lock()
        self.restored_total = 0  # positions restored instead of prefilled, since start
        self.faults = 0  # faults inside the cache (each one a miss, never a failed take), since start

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._slots)

    def _best(self, model: str, ids: torch.Tensor) -> tuple[Snapshot | None, int]:
        best, usable, n_ids = None, 0, int(ids.shape[0])
        for s in self._slots:
            if s.model == model:
                shared = common_prefix(s.ids, ids)
                whole = shared == n_ids == s.tokens and s.h is not None
                n = n_ids if whole else min(shared, n_ids - 1)
                if n > usable:
                    best, usable = s, n
        return best, usable

    def restore(
        self, model: str, ids: torch.Tensor, row0: KVCache, task: str = ""
    ) -> tuple[int, str, torch.Tensor | None]:
        """Copy the longest usable prefix into ``row0`` (positions [0, n)); returns n, its origin and,
        when all of ``ids`` were restored, the hidden state (1, H) of their last position.

        A fault inside the cache is a miss (0, "", None): it is logged, counted and the slots are
        dropped (what they hold is suspect); the caller prefills from position 0, which overwrites
        whatever a failed copy left in ``row0``."""
        try:
            return self._restore(model, ids, row0)
        except Exception as exc:
            self._fault("restore", task, exc)
            return 0, "", None

    def save(
        self, model: str, ids: torch.Tensor, row0: KVCache, origin: str, h: torch.Tensor | None = None, task: str = ""
    ) -> bool:
        """Keep row 0's KV for positions [0, len(ids)), and ``h`` (1, H) at the last one, unless a slot
        already covers these ids. A fault inside the cache is logged and counted; nothing is kept."""
        try:
            return self._save(model, ids, row0, origin, h)
        except Exception as exc:
            self._fault("save", task, exc)
            return False

    def _fault(self, what: str, task: str, exc: Exception) -> None:
        log.error(
            "task %s: kv snapshot %s failed; the slots are dropped and the prefix is prefilled",
            task or "-",
            what,
            exc_info=exc,
        )
        with self._lock:
            self.faults += 1
            self._slots.clear()

    def _restore(self, model: str, ids: torch.Tensor, row0: KVCache) -> tuple[int, str, torch.Tensor | None]:
        with self._lock:
            snap, n = self._best(model, ids)
            if snap is None or n <= 0:
                return 0, "", None
            snap.used_at, snap.hits = time.monotonic(), snap.hits + 1
            self._slots.remove(snap)
            self._slots.append(snap)  # most recently used last
        for dst, src in zip((*row0.k, *row0.v), (*snap.k, *snap.v), strict=True):
            dst[0, :, :n].copy_(src[:, :n], non_blocking=True)
        self.restored_total += n
        h = snap.h.to(row0.k[0].device, non_blocking=True) if n == int(ids.shape[0]) and snap.h is not None else None
        return n, snap.origin, h

    def _save(self, model: str, ids: torch.Tensor, row0: KVCache, origin: str, h: torch.Tensor | None) -> bool:
        n = int(ids.shape[0])
        per_position = sum(t[0, :, :1].numel() * t.element_size() for t in (*row0.k, *row0.v))
        need = n * per_position
        with self._lock:
            if any(s.model == model and common_prefix(s.ids, ids) == n for s in self._slots):
                return False  # a slot starts with exactly these ids: it serves them already
            if need > self.capacity:
                log.info("kv snapshot of %d tokens (%d bytes) is over KV_SNAPSHOT_MB; not kept", n, need)
                return False
        k = [self._keep(t[0, :, :n]) for t in row0.k]
        v = [self._keep(t[0, :, :n]) for t in row0.v]
        kept_h = None if h is None else self._keep(h)
        snap = Snapshot(model, ids.to("cpu", torch.long).clone(), k, v, origin, need, kept_h)
        with self._lock:
            # a slot whose ids this one starts with is served by this one: drop it
            self._slots = [s for s in self._slots if not (s.model == model and common_prefix(s.ids, ids) == s.tokens)]
            while self._slots and self.nbytes + need > self.capacity:
                gone = self._slots.pop(0)
                log.info("kv snapshot of %d tokens (%s) evicted", gone.tokens, gone.origin or "no origin")
            self._slots.append(snap)
        return True

    def _keep(self, t: torch.Tensor) -> torch.Tensor:
        if self.memory == "host" and t.device.type != "cpu":
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            out.copy_(t)
            return out
        return t.clone()

    def clear(self) -> None:
        with self._lock:
            self._slots.clear()

    def describe(self) -> dict[str, Any]:
        """``/health``'s ``kv_snapshots``: the slots (newest last), their bytes, the bound."""
        now = time.monotonic()
        with self._lock:
            slots = [
                {
                    "model": s.model,
                    "origin": s.origin,
                    "tokens": s.tokens,
                    "bytes": s.nbytes,
                    "hits": s.hits,
                    "idle_sec": round(now - s.used_at, 1),
                }
                for s in self._slots
            ]
        return {
            "slots": slots,
            "bytes": sum(s["bytes"] for s in slots),
            "capacity_bytes": self.capacity,
            "memory": self.memory,
            "restored_tokens": self.restored_total,
            "faults": self.faults,
        }
