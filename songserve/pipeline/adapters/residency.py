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
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from songserve.errors import RequestError
from songserve.pipeline.adapters.format import MAX_RANK, Adapter, AdapterError, ModelShape, adapter_names, read_adapter
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
    ) -> None:
        self.folder, self.capacity, self.max_rank = folder, max(1, capacity), max_rank
        self.shapes, self.base_models = shapes, frozenset(base_models)
        self._lock = threading.Lock()
        self._resident: OrderedDict[str, Resident] = OrderedDict()  # least recently used first
        self._loads = 0
        self.evictions = 0

    def available(self) -> list[str]:
        """The adapters the folder offers now."""
        return adapter_names(self.folder)

    def resident(self) -> list[str]:
        with self._lock:
            return list(self._resident)

    def _read(self, name: str) -> Adapter:
        if not NAME.match(name):
            raise RequestError(f"Field 'adapter': {name!r} is not an adapter name.")
        folder = self.folder / name
        if not folder.is_dir():
            raise RequestError(f"Field 'adapter': no adapter {name!r} in this worker's ADAPTERS_DIR.")
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
        return {"resident": resident, "capacity": self.capacity, "available": self.available()}


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
