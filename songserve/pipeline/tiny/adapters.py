"""The tiny adapter set: seeded LoRA adapters for the tiny checkpoint set, in the real layout.

Written into ``<tiny set>/adapters/`` (the tiny builder's own folder: ``build.py`` writes it with
every new set) or any folder a test names; point ``ADAPTERS_DIR`` at it. Four adapters of the
layout ``pipeline/adapters/format.py`` reads, of different ranks and targets, with weights large
enough that a take on one draws other tokens than the base model at the same seed:

    tiny-a    rank 8, alpha 16, every target of the backbone
    tiny-b    rank 4, alpha 4, the backbone's attention (linear_qkv, linear_proj)
    tiny-c    rank 2, alpha 8, the backbone's MLP (linear_fc1, linear_fc2)
    tiny-sr   rank 4, alpha 8, every target of the backbone and of super-resolution

``base_model_name_or_path`` is ``tiny``, the set's folder name (what a worker's checkpoint set
answers to). Deterministic: the same seed writes the same files.
"""

from __future__ import annotations

import fcntl
import json
import shutil
from pathlib import Path

import torch

from songserve.pipeline.adapters.format import Weights, write_adapter
from songserve.pipeline.adapters.residency import model_shape
from songserve.pipeline.engine.arch import GPTArch
from songserve.pipeline.engine.lora import TARGETS

SEED = 5309
VERSION = 1
MANIFEST = "ADAPTERS.json"
TINY_ADAPTERS: dict[str, tuple[int, float, tuple[str, ...], tuple[str, ...]]] = {
    # name: rank, alpha, targets, models
    "tiny-a": (8, 16.0, TARGETS, ("backbone",)),
    "tiny-b": (4, 4.0, ("linear_qkv", "linear_proj"), ("backbone",)),
    "tiny-c": (2, 8.0, ("linear_fc1", "linear_fc2"), ("backbone",)),
    "tiny-sr": (4, 8.0, TARGETS, ("backbone", "superres")),
}


def _weights(arch: GPTArch, rank: int, targets: tuple[str, ...], gen: torch.Generator) -> Weights:
    shape = model_shape(arch)
    out: Weights = {}
    for layer in range(shape.layers):
        for t in targets:
            n_in, n_out = shape.dims[t]
            a = torch.randn(rank, n_in, generator=gen) / n_in**0.5
            b = torch.randn(n_out, rank, generator=gen) * 0.5 / rank**0.5
            out[(layer, t)] = (a, b)
    return out


def write_tiny_adapters(folder: Path, archs: dict[str, GPTArch], base_model: str = "tiny") -> Path:
    """Write the set into ``folder`` (replaced whole, through a temporary folder beside it)."""
    tmp = folder.parent / f".{folder.name}.building"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    gen = torch.Generator().manual_seed(SEED)
    for name, (rank, alpha, targets, models) in TINY_ADAPTERS.items():
        weights = {m: _weights(archs[m], rank, targets, gen) for m in models}
        write_adapter(tmp / name, weights, rank, alpha, base_model)
    (tmp / MANIFEST).write_text(json.dumps({"tiny_adapters_version": VERSION, "seed": SEED}) + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def ensure_tiny_adapters(folder: Path, archs: dict[str, GPTArch], base_model: str = "tiny") -> Path:
    """Write the set unless a current one is there; safe to call from many processes."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            current = json.loads((folder / MANIFEST).read_text()).get("tiny_adapters_version") == VERSION
        except (OSError, ValueError):
            current = False
        if not current:
            write_tiny_adapters(folder, archs, base_model)
    return folder
