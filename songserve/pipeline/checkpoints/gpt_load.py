"""Megatron-LM GPT checkpoints: find the architecture, load the weights (writing: ``tiny/gpt_write.py``).

A checkpoint directory holds ``latest_checkpointed_iteration.txt`` and ``iter_NNNNNNN/`` with
either a ``torch_dist`` checkpoint (``.metadata``, ``common.pt``, ``__0_0.distcp`` …) or a legacy
``mp_rank_00/model_optim_rng.pt``. The architecture comes from Megatron-LM's saved ``args``
(``megatron_args.py``), optionally overridden by ``model_config.json`` beside the iterations and
then by ``MEGATRON_ARGS`` / the worker's Megatron flags. Sets without saved args (the project's
default tiny set) need ``model_config.json``.

Names: the release was trained with the Transformer-Engine layer spec, which fuses each layer's
norms into the following linear layer (``self_attention.linear_qkv.layer_norm_weight``,
``mlp.linear_fc1.layer_norm_weight``); we build the local spec (no Transformer Engine), whose
names are ``input_layernorm.weight`` and ``pre_mlp_layernorm.weight``. The maths is the same: TE's
``LayerNormLinear`` normalises, then multiplies. Keys are mapped at load time for both formats.

Checked against megatron-core 0.16.1 (extensions/transformer_engine.py, transformer/mlp.py):
``MLP`` builds ``linear_fc1`` with ``skip_bias_add=True``, the TE wrapper then passes
``return_bias=True`` so TE returns the bias unadded, and ``MLP.forward`` adds it once (or fuses
it once into the activation). The "fc1 bias added twice" that a third-party port reports is not
what megatron-core computes; we add it once, as the local spec does.

Memory: the model is built on the meta device and only allocated (``build_model(init=False)``);
``torch_dist`` loads read straight into the parameters, SwiGLU halves included (the sharded
factories are expanded into views of the fused ``linear_fc1`` tensors, so nothing is merged and
copied afterwards).
"""

from __future__ import annotations

import io
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch

from songserve.errors import ConfigError
from songserve.pipeline.checkpoints.megatron_args import (
    arch_fields_from_args,
    check_parallel,
    flags_to_arch_overrides,
    parse_flags,
    read_saved_args,
    safe_load,
    safe_unpickling,
)
from songserve.pipeline.engine.arch import MODEL_CONFIG, GPTArch
from songserve.pipeline.engine.gpt import AcousticGPT, build_model

log = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
LEGACY_FILE = Path("mp_rank_00") / "model_optim_rng.pt"

# Transformer-Engine spec name ↔ local spec name (a key suffix inside each layer).
_TE_NAMES = (
    (".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight"),
    (".input_layernorm.bias", ".self_attention.linear_qkv.layer_norm_bias"),
    (".pre_mlp_layernorm.weight", ".mlp.linear_fc1.layer_norm_weight"),
    (".pre_mlp_layernorm.bias", ".mlp.linear_fc1.layer_norm_bias"),
)


def local_to_te(key: str) -> str:
    for local, te in _TE_NAMES:
        if key.endswith(local):
            return key[: -len(local)] + te
    return key


def te_to_local(key: str) -> str:
    for local, te in _TE_NAMES:
        if key.endswith(te):
            return key[: -len(te)] + local
    return key


def iteration_dir(path: Path) -> Path:
    tracker = path / TRACKER
    if not tracker.is_file():
        return path
    it = tracker.read_text().strip()
    try:
        return path / ("release" if it == "release" else f"iter_{int(it):07d}")
    except ValueError:
        raise ConfigError(f"{tracker} holds {it!r}, not an iteration number.") from None


def guess_kind(path: Path) -> str:
    return "superres" if "super" in path.name.lower() else "backbone"


# ---- architecture ------------------------------------------------------------------------------


def resolve_arch(path: Path, kind: str | None = None, megatron_args: str = "") -> tuple[GPTArch, str]:
    """The architecture and where it came from: saved args < ``model_config.json`` < flags."""
    it_dir = iteration_dir(path)
    flags = parse_flags(megatron_args) if megatron_args.strip() else {}
    saved = read_saved_args(it_dir)
    cfg = path / MODEL_CONFIG
    check_parallel(flags, f"MEGATRON_ARGS for {path.name}")
    if saved is None:
        if not cfg.is_file():
            raise ConfigError(
                f"Checkpoint {path} has neither Megatron-LM saved args (in {it_dir.name}/common.pt or "
                f"{LEGACY_FILE}) nor a {MODEL_CONFIG}."
            )
        return GPTArch.from_json(cfg, flags_to_arch_overrides(flags)), str(cfg)
    source = f"saved args of {path}"
    fields = arch_fields_from_args(kind or guess_kind(path), {**saved, **flags}, source)
    if cfg.is_file():
        try:
            fields.update(json.loads(cfg.read_text()))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{cfg} is not valid JSON: {exc}.") from None
        source += f" + {cfg.name}"
    return GPTArch.from_fields(fields, source), source


# ---- loading -----------------------------------------------------------------------------------


def _stored_tensors(it_dir: Path) -> dict[str, tuple[int, ...]]:
    from torch.distributed.checkpoint import FileSystemReader  # type: ignore[attr-defined]

    md = FileSystemReader(str(it_dir)).read_metadata().state_dict_metadata
    return {k: tuple(v.size) for k, v in md.items() if hasattr(v, "size")}


def _request(
    model: Any, metadata: dict[str, Any] | None, stored: dict[str, tuple[int, ...]], path: Path
) -> dict[str, Any]:
    """The model's sharded state dict, named as stored, every tensor a view of a parameter."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out: dict[str, Any] = {}
    for k, v in model.sharded_state_dict(metadata=metadata).items():
        if isinstance(v, ShardedTensorFactory):
            built = v.build()  # the SwiGLU halves: views of linear_fc1's fused tensor
            parts = built if isinstance(built, list) else [built]
        elif isinstance(v, ShardedTensor):
            parts = [v]
        else:
            continue  # _extra_state objects: nothing the local spec needs
        for p in parts:
            if p.key not in stored and local_to_te(p.key) in stored:
                p.key = local_to_te(p.key)
            if p.key not in stored:
                raise ConfigError(f"Checkpoint {path} has no tensor {p.key!r}.")
            if tuple(p.global_shape) != stored[p.key]:
                raise ConfigError(
                    f"Checkpoint {path} does not match its model config: {p.key} is {list(stored[p.key])} "
                    f"in the file, {list(p.global_shape)} in the model."
                )
        out[k] = parts if isinstance(v, ShardedTensorFactory) else v
    return out


class _FileSlice(io.RawIOBase):
    """A seekable read-only window [offset, offset + length) of an open file (one DCP item)."""

    def __init__(self, f: io.RawIOBase | io.BufferedIOBase, offset: int, length: int) -> None:
        super().__init__()
        self.f, self.base, self.length, self.pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = {0: pos, 1: self.pos + pos, 2: self.length + pos}[whence]
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buf: Any) -> int:
        n = max(0, min(len(buf), self.length - self.pos))
        self.f.seek(self.base + self.pos)
        got = self.f.readinto(memoryview(buf)[:n])
        self.pos += got
        return got


def _read_into(f: io.RawIOBase | io.BufferedIOBase, offset: int, dst: torch.Tensor, stored: torch.dtype) -> None:
    """Copy ``dst.numel()`` elements of dtype ``stored`` at ``offset`` into ``dst``, without a full temporary."""
    flat = dst.view(-1)
    f.seek(offset)
    if dst.device.type == "cpu" and dst.dtype == stored:
        view = memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]
        got = 0
        while got < len(view):
            k = f.readinto(view[got:])
            if not k:
                raise OSError(f"unexpected end of file at byte {offset + got}")
            got += k
        return
    step = max(1, _CHUNK_BYTES // stored.itemsize)
    buf = torch.empty(min(step, flat.numel()), dtype=stored)
    for a in range(0, flat.numel(), step):
        part = buf[: min(step, flat.numel() - a)]
        if f.readinto(memoryview(part.view(torch.uint8).numpy())) != part.numel() * stored.itemsize:  # type: ignore[arg-type]
            raise OSError(f"unexpected end of file near byte {offset + a * stored.itemsize}")
        flat[a : a + part.numel()].copy_(part)


_CHUNK_BYTES = 64 << 20


def _direct_read(request: dict[str, Any], it_dir: Path) -> bool:
    """Read each tensor of the request straight from the .distcp files into its parameter.

    torch's reader loads every item into a new tensor and then copies it: twice the time and a
    temporary as large as the largest tensor (the embedding). Items of a torch_dist file are
    uncompressed zip records, so when every requested tensor is one whole stored chunk we read its
    bytes in place. Returns False (having read nothing) when anything is unusual, and the caller
    falls back to megatron's loader.
    """
    import re

    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from torch.distributed.checkpoint import FileSystemReader  # type: ignore[attr-defined]
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    md = FileSystemReader(str(it_dir)).read_metadata()
    jobs: list[tuple[str, int, int, torch.Tensor, torch.dtype]] = []
    for v in request.values():
        for sh in v if isinstance(v, list) else [v]:
            tmd = md.state_dict_metadata.get(sh.key)
            if not isinstance(sh, ShardedTensor) or not isinstance(tmd, TensorStorageMetadata):
                return False
            if sh.flattened_range is not None or not sh.data.is_contiguous():
                return False
            chunk = next((c for c in tmd.chunks if tuple(c.offsets) == tuple(sh.global_offset)), None)
            if chunk is None or math.prod(chunk.sizes) != sh.data.numel():
                return False
            info = md.storage_data.get(MetadataIndex(sh.key, chunk.offsets))
            if info is None or info.transform_descriptors:
                return False
            jobs.append((info.relative_path, info.offset, info.length, sh.data, tmd.properties.dtype))
    by_file: dict[str, list[tuple[int, int, torch.Tensor, torch.dtype]]] = {}
    for rel, off, length, dst, dtype in jobs:
        by_file.setdefault(rel, []).append((off, length, dst, dtype))
    plans: list[tuple[str, int, torch.Tensor, torch.dtype]] = []
    for rel, items in by_file.items():
        with open(it_dir / rel, "rb") as f:
            for off, length, dst, dtype in items:
                reader = torch._C.PyTorchFileReader(_FileSlice(f, off, length))  # type: ignore[call-overload]
                data = [r for r in reader.get_all_records() if re.fullmatch(r"(.*/)?data/\d+", r)]
                if len(data) != 1:
                    return False
                start = reader.get_record_offset(data[0])
                if start + dst.numel() * dtype.itemsize > length:
                    return False
                plans.append((rel, off + start, dst, dtype))
    for rel in by_file:
        with open(it_dir / rel, "rb", buffering=0) as f:
            for _, at, dst, dtype in (p for p in sorted(plans, key=lambda p: p[1]) if p[0] == rel):
                _read_into(f, at, dst, dtype)
    return True


def _load_torch_dist(model: Any, it_dir: Path, path: Path) -> None:
    from megatron.core import dist_checkpointing

    with safe_unpickling():
        common = dist_checkpointing.load_common_state_dict(str(it_dir))
    metadata = dist_checkpointing.load_content_metadata(preloaded_state_dict=common)
    request = _request(model, metadata, _stored_tensors(it_dir), path)
    with torch.no_grad():
        if _direct_read(request, it_dir):
            return
    log.info("%s: the files are not plain whole-tensor items; loading through megatron's reader", path)
    params = model.state_dict(keep_vars=True)
    with safe_unpickling():
        loaded = dist_checkpointing.load(request, str(it_dir))
    for k in request:  # the result also holds common.pt's entries (args, iteration)
        val = loaded[k]
        target = params[k].data
        halves = val if isinstance(val, list) else [val]
        dests = torch.chunk(target, len(halves), dim=0)
        for dst, src in zip(dests, halves, strict=True):
            if src.data_ptr() != dst.data_ptr():  # megatron's reader returned a new tensor: copy it in
                dst.copy_(src)


def _load_legacy(model: Any, file: Path, path: Path) -> None:
    obj = safe_load(file, mmap=True)
    state = obj.get("model") if isinstance(obj, dict) else None
    if not isinstance(state, dict):
        raise ConfigError(f"Checkpoint file {file} has no 'model' state dict.")
    state = {te_to_local(k): v for k, v in state.items() if not k.endswith("_extra_state")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ConfigError(
            f"Checkpoint {path} does not match its model config: missing {missing[:3]}, unexpected {unexpected[:3]}."
        )


def load_model(
    path: Path,
    device: torch.device,
    dtype: torch.dtype,
    megatron_args: str = "",
    kind: str | None = None,
) -> AcousticGPT:
    """Build the model from the checkpoint's architecture and load its weights with strict key checks."""
    from torch.distributed.checkpoint.api import CheckpointException

    if not path.is_dir():
        raise ConfigError(f"Checkpoint directory {path} does not exist.")
    t0 = time.perf_counter()
    arch, source = resolve_arch(path, kind, megatron_args)
    it_dir = iteration_dir(path)
    model = build_model(arch, device, dtype, init=False)
    try:
        if (it_dir / ".metadata").is_file():
            _load_torch_dist(model, it_dir, path)
        elif (it_dir / LEGACY_FILE).is_file():
            _load_legacy(model, it_dir / LEGACY_FILE, path)
        else:
            raise ConfigError(f"Checkpoint {it_dir} holds neither a torch_dist checkpoint nor {LEGACY_FILE}.")
    except ConfigError:
        raise
    except (Exception, CheckpointException) as exc:  # many types; torch's is a BaseException
        reason = [ln for ln in str(exc).splitlines() if ln.strip()][-1:] or [type(exc).__name__]
        raise ConfigError(f"Checkpoint {path} does not match its model config: {reason[0].strip()}") from None
    gpt = AcousticGPT(arch, model)
    gpt.load_sec = time.perf_counter() - t0
    log.info(
        "%s %s: %d layers, hidden %d, %d heads / %s groups, %s, %s ε=%g, vocab %d (padded %d, T=%d); arch from %s; "
        "loaded in %.2fs",
        arch.kind,
        path,
        arch.num_layers,
        arch.hidden_size,
        arch.num_attention_heads,
        arch.num_query_groups or arch.num_attention_heads,
        arch.position_embedding_type,
        arch.normalization,
        arch.norm_epsilon,
        arch.vocab_size,
        arch.rows,
        arch.text_vocab_size,
        source,
        gpt.load_sec,
    )
    return gpt
