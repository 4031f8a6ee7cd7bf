"""Which adapters a worker holds: at most ``MAX_ADAPTERS``, least recently used evicted, each in a slot.

An adapter is loaded (read and checked, ``format.py``) the first time a request names it, into host
memory, and given one of the slots ``1..capacity``: every model's ``engine/lora.py`` slots mirror
that numbering, and a batch installs an adapter into a model's slot only when that slot holds
something else (``install``: a copy of a few MB, on the model thread). When all slots are taken,
the least recently used adapter that the batch at hand does not need is evicted and its slot
reused; a batch that needs more distinct adapters than there are slots is refused.

Loading may run off the model thread (``prefetch``, from the worker's request handler): the file
reading and checks run outside the lock, the bookkeeping under it. A prefetch that evicts an
adapter never changes what a running batch reads: the models' slots change only when the next
batch installs on the model thread. ``describe`` (``/health``) reads under the lock too.

Adapters come from two folders, one namespace: ``ADAPTERS_DIR`` (the operator's, may be read-only)
and the uploads folder (``ADAPTER_UPLOADS_DIR``), where the dispatcher puts what keys upload
(``upload``: checked here exactly as a folder adapter is at load, then renamed into place, so a
half-written adapter is never listed; ``remove``). Replacing or removing an upload evicts its
resident copy from the bookkeeping only: a batch running with it keeps reading its slot until it
ends, and the next batch that names it loads the new files (its load number changes the slot's key).
Each upload's weights' SHA-256 is in ``/health`` (``uploaded``), so a dispatcher can tell a stale copy.
"""

from __future__ import annotations

import hashlib
import logging
import re
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from songserve.errors import ConflictError, FieldError, NotFoundError, RequestError
from songserve.pipeline.adapters.format import (
    CONFIG,
    MAX_RANK,
    WEIGHTS,
    Adapter,
    AdapterError,
    ModelShape,
    adapter_names,
    read_adapter,
)
from songserve.pipeline.engine.arch import GPTArch
from songserve.pipeline.engine.transformer import DecodeModel
from songserve.schemas.common import ADAPTER_PATTERN

log = logging.getLogger(__name__)
NAME = re.compile(ADAPTER_PATTERN)  # the contract's: a folder name, never a path


@dataclass
class Resident:
    """A loaded adapter, its slot, and how often takes used it."""

    adapter: Adapter
    slot: int
    load: int  # which load this is (a reload of the same name is another): the models' slots' key
    hits: int = 0
    loaded_at: float = field(default_factory=time.time)

    @property
    def key(self) -> str:
        return f"{self.adapter.name}#{self.load}"

    def describe(self) -> dict[str, Any]:
        a = self.adapter
        return {
            "name": a.name,
            "rank": a.rank,
            "targets": list(a.targets),
            "models": sorted(a.weights),
            "bytes": a.nbytes,
            "hits": self.hits,
            "slot": self.slot,
        }


def model_shape(arch: GPTArch) -> ModelShape:
    """What an adapter of a model of ``arch`` must fit (``DecodeModel.lora_dims`` without the model)."""
    kv = arch.kv_channels or arch.hidden_size // arch.num_attention_heads
    groups = arch.num_query_groups or arch.num_attention_heads
    h, heads, ffn = arch.hidden_size, arch.num_attention_heads, arch.ffn_hidden_size
    return ModelShape(
        arch.num_layers,
        {
            "linear_qkv": (h, (heads + 2 * groups) * kv),
            "linear_proj": (heads * kv, h),
            "linear_fc1": (h, ffn * (2 if arch.gated_linear_unit else 1)),
            "linear_fc2": (ffn, h),
        },
    )


class AdapterStore:
    """The adapters of ``folder`` this worker holds (see the module docstring)."""

    def __init__(
        self,
        folder: Path,
        capacity: int,
        shapes: dict[str, ModelShape],
        base_models: set[str] | frozenset[str] = frozenset(),
        max_rank: int = MAX_RANK,
        uploads: Path | None = None,
    ) -> None:
        self.folder, self.capacity, self.max_rank = folder, max(1, capacity), max_rank
        self.uploads = uploads
        self.shapes, self.base_models = shapes, frozenset(base_models)
        self._lock = threading.Lock()
        self._resident: OrderedDict[str, Resident] = OrderedDict()  # least recently used first
        self._loads = 0
        self.evictions = 0
        self._uploaded = {n: sha256_of(uploads / n / WEIGHTS) for n in _names(uploads)} if uploads else {}

    def available(self) -> list[str]:
        """The adapters both folders offer now (a name in both is the operator's)."""
        return sorted(set(_names(self.folder)) | set(self.uploaded()))

    def uploaded(self) -> dict[str, str]:
        """The uploaded adapters this worker holds, each with its weights' SHA-256."""
        operators = set(_names(self.folder))
        with self._lock:
            return {n: h for n, h in self._uploaded.items() if n not in operators}

    def _where(self, name: str) -> Path:
        """The folder of adapter ``name``: the operator's ``ADAPTERS_DIR`` first, then the uploads."""
        folder = self.folder / name
        if folder.is_dir() or self.uploads is None:
            return folder
        return self.uploads / name

    def upload(self, name: str, config: IO[bytes], weights: IO[bytes]) -> dict[str, Any]:
        """Write an upload's two files into a staged folder beside the uploads (same file system),
        check them as a folder adapter is checked at load, then rename the folder to ``name``
        (replacing one of that name). Raises ``FieldError`` naming ``config`` or ``weights`` and the
        reason, ``ConflictError`` for a name of ``ADAPTERS_DIR``; nothing is kept on a refusal."""
        if self.uploads is None:
            raise RequestError("This worker takes no adapter uploads (ADAPTER_UPLOADS_DIR is not set).")
        if not NAME.match(name):
            raise FieldError("name", f"{name[:80]!r} is not an adapter name")
        if name in _names(self.folder):
            raise ConflictError(f"Adapter name {name!r} is taken by this worker's ADAPTERS_DIR.")
        self.uploads.mkdir(parents=True, exist_ok=True)
        staged = Path(tempfile.mkdtemp(prefix=".staged-", dir=self.uploads))
        old = staged.with_name(f".old-{staged.name}")
        try:
            for data, filename in ((config, CONFIG), (weights, WEIGHTS)):
                with (staged / filename).open("wb") as out:
                    shutil.copyfileobj(data, out)
            try:
                adapter = read_adapter(staged, self.shapes, self.base_models, self.max_rank)
            except AdapterError as exc:
                said = str(exc).replace(f"{staged}/", "")
                raise FieldError("weights" if said.startswith(WEIGHTS) else "config", said) from None
            digest = sha256_of(staged / WEIGHTS)
            target = self.uploads / name
            with self._lock:
                if target.exists():
                    target.rename(old)
                staged.rename(target)
                self._uploaded[name] = digest
                self._forget(name)
        finally:
            shutil.rmtree(staged, ignore_errors=True)
            shutil.rmtree(old, ignore_errors=True)
        log.info("adapter %s uploaded (rank %d, sha256 %s)", name, adapter.rank, digest[:12])
        return {**adapter.describe(), "name": name, "sha256": digest}

    def remove(self, name: str, sha256: str | None = None) -> None:
        """Remove upload ``name`` (a batch running with it finishes with its slot); ``NotFoundError`` when
        there is none (a name of ``ADAPTERS_DIR`` is never removed).

        ``sha256``: only the copy whose weights have this digest; another copy of the name is kept
        (``ConflictError``). A dispatcher removes the copy it knows of, so that a newer upload of the same
        name, sent meanwhile by another dispatcher of the fleet, is not removed in its place."""
        if self.uploads is None or not NAME.match(name) or name in _names(self.folder):
            raise NotFoundError(f"No uploaded adapter {name[:80]!r} on this worker.")
        gone = self.uploads / f".removed-{name}-{time.monotonic_ns()}"
        with self._lock:
            held = self._uploaded.get(name)
            if held is None:
                raise NotFoundError(f"No uploaded adapter {name!r} on this worker.")
            if sha256 is not None and held != sha256:
                raise ConflictError(
                    f"Field 'sha256': this worker holds another copy of adapter {name!r} "
                    f"(sha256 {held[:12]}…, not {sha256[:12]}…); it was kept."
                )
            del self._uploaded[name]
            (self.uploads / name).rename(gone)
            self._forget(name)
        shutil.rmtree(gone, ignore_errors=True)
        log.info("adapter %s removed (upload deleted)", name)

    def _forget(self, name: str) -> None:
        """Under the lock: ``name`` is no longer resident; its slot goes to the next adapter placed."""
        if self._resident.pop(name, None) is not None:
            self.evictions += 1

    def resident(self) -> list[str]:
        with self._lock:
            return list(self._resident)

    def _read(self, name: str) -> Adapter:
        if not NAME.match(name):
            raise RequestError(f"Field 'adapter': {name!r} is not an adapter name.")
        folder = self._where(name)
        if not folder.is_dir():
            raise RequestError(f"Field 'adapter': no adapter {name!r} in this worker's ADAPTERS_DIR or uploads.")
        try:
            return read_adapter(folder, self.shapes, self.base_models, self.max_rank)
        except AdapterError as exc:
            raise RequestError(f"Field 'adapter': adapter {name!r} cannot be loaded: {exc}.") from None

    def get(self, name: str, keep: set[str] | frozenset[str] = frozenset(), hit: bool = True) -> Resident:
        """``name`` resident (loaded now when it is not), counted as used by a take when ``hit``; an
        eviction spares ``keep`` (the batch's other adapters). Raises ``RequestError`` naming
        ``adapter`` and the reason."""
        with self._lock:
            got = self._resident.get(name)
            if got is not None:
                self._resident.move_to_end(name)
                got.hits += hit
                return got
        adapter = self._read(name)  # off the lock: the disk and the checks
        with self._lock:
            got = self._place(adapter, keep)
            got.hits += hit
            return got

    def prefetch(self, name: str) -> None:
        """Load ``name`` ahead of its batch (off the model thread); a failure is left for the batch to report."""
        with self._lock:
            if name in self._resident:
                return
        try:
            adapter = self._read(name)
        except Exception as exc:  # the batch loads it again and reports what went wrong
            log.info("adapter %s not prefetched: %s", name, exc)
            return
        with self._lock:
            if name not in self._resident:
                try:
                    self._place(adapter, frozenset())
                except RequestError:
                    pass

    def _place(self, adapter: Adapter, keep: set[str] | frozenset[str]) -> Resident:
        """Under the lock: give ``adapter`` a slot, evicting the least recently used not in ``keep``."""
        got = self._resident.get(adapter.name)
        if got is not None:  # loaded meanwhile by another thread
            self._resident.move_to_end(adapter.name)
            return got
        used = {r.slot for r in self._resident.values()}
        free = [s for s in range(1, self.capacity + 1) if s not in used]
        if not free:
            victim = next((n for n in self._resident if n not in keep), None)
            if victim is None:
                raise RequestError(
                    f"Field 'adapter': a batch names more adapters than this worker holds at once "
                    f"(MAX_ADAPTERS={self.capacity})."
                )
            gone = self._resident.pop(victim)
            self.evictions += 1
            log.info("adapter %s evicted from slot %d (least recently used)", victim, gone.slot)
            free = [gone.slot]
        self._loads += 1
        got = Resident(adapter, free[0], self._loads)
        self._resident[adapter.name] = got
        log.info(
            "adapter %s loaded into slot %d (rank %d, %d bytes)", adapter.name, got.slot, adapter.rank, adapter.nbytes
        )
        return got

    def describe(self) -> dict[str, Any]:
        """``/health``'s ``adapters``: what is resident, the capacity, what the folder offers."""
        with self._lock:
            resident = [r.describe() for r in self._resident.values()]
        return {
            "resident": resident,
            "capacity": self.capacity,
            "available": self.available(),
            "uploaded": self.uploaded(),
        }


def _names(folder: Path | None) -> list[str]:
    """A folder's adapters by the contract's names (a staged or removed folder starts with a dot)."""
    return [n for n in adapter_names(folder) if NAME.match(n)] if folder is not None else []


def sha256_of(path: Path) -> str:
    """The SHA-256 of a file, read a megabyte at a time."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def install(dm: DecodeModel, res: Resident, model: str, capacity: int, rank: int = MAX_RANK) -> float:
    """Put ``res`` into its slot of ``dm`` (of kind ``model``) unless it is there already; returns
    the factor ``alpha/r`` its rows use, 0 when the adapter does not adapt this model."""
    weights = res.adapter.weights.get(model)
    if not weights:
        return 0.0
    dims, r = dm.lora_dims(), res.adapter.rank
    for (layer, target), (a, b) in weights.items():  # a set with several models of one kind: checked per model
        if layer >= len(dm.layers) or (a.shape[1], b.shape[0]) != dims[target]:
            raise RequestError(
                f"Field 'adapter': adapter {res.adapter.name!r} does not fit this {model} "
                f"(layer {layer} {target}: rank {r}, {a.shape[1]} → {b.shape[0]}; the model's {dims[target]})."
            )
    slots = dm.lora_slots(capacity, rank)
    if slots.held[res.slot] != res.key:
        slots.install(
            res.slot,
            res.key,
            {k: (a.to(dm.device, dm.dtype), b.to(dm.device, dm.dtype)) for k, (a, b) in weights.items()},
        )
    return res.adapter.scaling
