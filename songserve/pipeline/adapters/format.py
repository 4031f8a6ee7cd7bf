"""An adapter's files, read and checked: PEFT's layout with Megatron's module names (docs/model.md).

One adapter is a folder ``<ADAPTERS_DIR>/<name>/`` holding

    adapter_config.json          r, lora_alpha, target_modules, base_model_name_or_path (PEFT's keys)
    adapter_model.safetensors    per adapted linear layer ``<key>.lora_A.weight`` (r × in) and
                                 ``<key>.lora_B.weight`` (out × r)

where ``<key>`` is ``<model>.decoder.layers.<i>.self_attention.linear_qkv`` (or ``linear_proj``) or
``<model>.decoder.layers.<i>.mlp.linear_fc1`` (or ``linear_fc2``), and ``<model>`` is
``backbone`` or ``superres``: which of the two acoustic models the tensor adapts, so one adapter
may adapt either or both. PEFT's own ``base_model.model.`` prefix is accepted before it. The
delta is ``(alpha / r)·B·A`` on that layer's weight, times the request's scale.

Everything that could go wrong is checked here, when the adapter is loaded, never at generation
time: a missing or unreadable config, missing keys, a rank of 0 or above the slots' rank, a
target that is not one of the four, a file that is not safetensors, a tensor name that is not an
adapted module of a model this worker serves (or of a target the config does not list), an A
without its B, wrong shapes, NaN or infinite weights, a base model other than this checkpoint
set's. Each refusal is an ``AdapterError`` naming the file and the problem.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from songserve.pipeline.adapters.safetensors_file import SafetensorsError, read_safetensors
from songserve.pipeline.engine.lora import TARGETS
from songserve.schemas.common import ADAPTER_CONFIG, ADAPTER_WEIGHTS

CONFIG, WEIGHTS = ADAPTER_CONFIG, ADAPTER_WEIGHTS
MODELS = ("backbone", "superres")
MAX_RANK = 64  # the slots' rank (``engine/lora.py``): every slot is this wide
PARENT = {"linear_qkv": "self_attention", "linear_proj": "self_attention", "linear_fc1": "mlp", "linear_fc2": "mlp"}
KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<model>[a-z_]+)\.decoder\.layers\.(?P<layer>\d+)\."
    r"(?P<parent>[a-z_]+)\.(?P<target>[a-z_0-9]+)\.lora_(?P<ab>[AB])\.weight$"
)


class AdapterError(ValueError):
    """An adapter that cannot be used: the message names the file and the problem."""


@dataclass(frozen=True)
class ModelShape:
    """What an adapter of one model must fit: its layer count and each target's (in, out) features."""

    layers: int
    dims: dict[str, tuple[int, int]]


Weights = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, target) → (A (r, in), B (out, r))


@dataclass
class Adapter:
    """One adapter, checked, its weights in fp32 on the CPU."""

    name: str
    folder: Path
    rank: int
    alpha: float
    targets: tuple[str, ...]  # of TARGETS, as the config lists them
    base_model: str
    weights: dict[str, Weights] = field(default_factory=dict)  # model ("backbone"/"superres") → its layers'

    @property
    def scaling(self) -> float:
        """alpha / r: the delta's factor at scale 1."""
        return self.alpha / self.rank

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for w in self.weights.values() for a, b in w.values())

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "rank": self.rank,
            "alpha": self.alpha,
            "targets": list(self.targets),
            "models": sorted(self.weights),
            "base_model": self.base_model,
            "bytes": self.nbytes,
        }


def adapter_names(folder: Path) -> list[str]:
    """The adapters a folder offers: its subfolders holding an ``adapter_config.json``."""
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if (p / CONFIG).is_file())


def _config(path: Path, max_rank: int) -> tuple[int, float, tuple[str, ...], str]:
    if not path.is_file():
        raise AdapterError(f"{path}: no such file (an adapter folder holds {CONFIG} and {WEIGHTS})")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{path}: not a JSON object")
    missing = [k for k in ("r", "lora_alpha", "target_modules") if k not in cfg]
    if missing:
        raise AdapterError(f"{path}: missing key(s) {', '.join(missing)}")
    r, alpha, targets = cfg["r"], cfg["lora_alpha"], cfg["target_modules"]
    if not isinstance(r, int) or isinstance(r, bool) or not 1 <= r <= max_rank:
        raise AdapterError(f"{path}: rank r={r!r} is not an integer in 1..{max_rank} (the slots' rank)")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha) or alpha <= 0:
        raise AdapterError(f"{path}: lora_alpha={alpha!r} is not a finite positive number")
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise AdapterError(f"{path}: target_modules must be a non-empty list of module names")
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        raise AdapterError(f"{path}: unknown target module(s) {', '.join(unknown)}; known: {', '.join(TARGETS)}")
    base = cfg.get("base_model_name_or_path") or ""
    if not isinstance(base, str):
        raise AdapterError(f"{path}: base_model_name_or_path is not a string")
    return r, float(alpha), tuple(dict.fromkeys(targets)), base


def read_adapter(
    folder: Path,
    shapes: dict[str, ModelShape],
    base_models: set[str] | frozenset[str] = frozenset(),
    max_rank: int = MAX_RANK,
) -> Adapter:
    """Read and check the adapter in ``folder`` against the models it may adapt (``shapes``, by
    model kind) and the names this checkpoint set answers to (``base_models``: an adapter that
    names another base model is refused; none named, or none known, is not checked)."""
    r, alpha, targets, base = _config(folder / CONFIG, max_rank)
    if base and base_models and base.rstrip("/").rsplit("/", 1)[-1] not in base_models:
        raise AdapterError(
            f"{folder / CONFIG}: trained on base model {base!r}, not this checkpoint set "
            f"({', '.join(sorted(base_models))})"
        )
    path = folder / WEIGHTS
    if not path.is_file():
        raise AdapterError(f"{path}: no such file")
    try:
        tensors = read_safetensors(path)
    except (SafetensorsError, OSError) as exc:
        raise AdapterError(f"{path}: not a safetensors file ({exc})") from None
    if not tensors:
        raise AdapterError(f"{path}: holds no tensors")
    halves: dict[tuple[str, int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = KEY.match(key)
        if m is None:
            raise AdapterError(
                f"{path}: {key!r} is not a LoRA tensor of an adapted module (<model>.decoder.layers.<i>.…)"
            )
        model, layer, target = m["model"], int(m["layer"]), m["target"]
        if model not in MODELS:
            raise AdapterError(f"{path}: {key!r}: unknown model {model!r}; known: {', '.join(MODELS)}")
        if target not in TARGETS or PARENT[target] != m["parent"]:
            raise AdapterError(f"{path}: {key!r}: unknown module {m['parent']}.{target}")
        if target not in targets:
            raise AdapterError(f"{path}: {key!r}: module {target} is not in the config's target_modules")
        if model not in shapes:
            raise AdapterError(f"{path}: {key!r}: this worker serves no {model} model")
        if layer >= shapes[model].layers:
            raise AdapterError(f"{path}: {key!r}: layer {layer} of a {shapes[model].layers}-layer {model}")
        if not t.is_floating_point():
            raise AdapterError(f"{path}: {key!r}: dtype {t.dtype} is not floating point")
        if not bool(torch.isfinite(t).all()):
            raise AdapterError(f"{path}: {key!r}: holds NaN or infinite values")
        halves.setdefault((model, layer, target), {})[m["ab"]] = t.to(torch.float32)
    weights: dict[str, Weights] = {}
    for (model, layer, target), ab in sorted(halves.items()):
        where = f"{model}.decoder.layers.{layer}.{PARENT[target]}.{target}"
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{path}: {where} has lora_{''.join(ab)} without lora_{'B' if 'A' in ab else 'A'}")
        n_in, n_out = shapes[model].dims[target]
        a, b = ab["A"], ab["B"]
        if tuple(a.shape) != (r, n_in) or tuple(b.shape) != (n_out, r):
            raise AdapterError(
                f"{path}: {where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
                f"this model needs ({r}, {n_in}) and ({n_out}, {r})"
            )
        weights.setdefault(model, {})[(layer, target)] = (a, b)
    return Adapter(folder.name, folder, r, alpha, targets, base, weights)


def write_adapter(
    folder: Path,
    weights: dict[str, Weights],
    rank: int,
    alpha: float,
    base_model: str = "",
) -> None:
    """Write an adapter in the layout ``read_adapter`` reads (the tiny set's builder, tests)."""
    from songserve.pipeline.adapters.safetensors_file import write_safetensors

    folder.mkdir(parents=True, exist_ok=True)
    targets = sorted({t for w in weights.values() for _, t in w}, key=TARGETS.index)
    tensors: dict[str, torch.Tensor] = {}
    for model, w in weights.items():
        for (layer, target), (a, b) in w.items():
            key = f"{model}.decoder.layers.{layer}.{PARENT[target]}.{target}"
            tensors[f"{key}.lora_A.weight"] = a
            tensors[f"{key}.lora_B.weight"] = b
    write_safetensors(folder / WEIGHTS, tensors, {"format": "pt"})
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": targets,
        "base_model_name_or_path": base_model,
        "bias": "none",
    }
    (folder / CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
