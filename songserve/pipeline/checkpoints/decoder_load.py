"""Reading decoder checkpoints: safe unpickling, the layouts met in practice, strict keys, low memory.

Layouts (all with or without the ``generator.`` prefix, tensors at the top or under ``state_dict``):
- the release's Lightning checkpoint: ``generator.decoder.*`` (weight-normed ``weight_g``/``weight_v``),
  ``generator.quantizer.vq_layer_{i}._codebook.{embed,embed_avg,cluster_size,inited}`` and
  ``generator.quantizer.embed_{i}``, beside ``generator.encoder.*``, ``discriminator.*`` and training
  entries (optimizer states, loops, callbacks), which are never read;
- the project's tiny set: ``generator.decoder.*`` + ``generator.quantizer.quantizers.{i}.codebook.weight``;
- DAC's own files: ``{"state_dict", "metadata": {"kwargs"}}`` with factorised codebooks.

Which release tensor is the codebook at decode, settled by the reference's code, not inferred:
- ``DacRVQ.decode`` → ``ResidualVectorQuantization.decode`` → per level ``VectorQuantization.decode``
  = ``F.embedding(codes, _codebook.embed)`` then ``project_out``, the identity because ``codebook_dim``
  defaults to ``dim`` (rvq.py), so the latent is the sum of the 64 selected ``_codebook.embed`` rows.
- ``quantizer.embed_{i}`` is not a second tensor: rvq.py's ``self.register_parameter(f"embed_{i}",
  vq_layer._codebook.embed)`` registers the *same* ``Parameter`` under a second name. The reference
  loads with ``decoder.load_state_dict(generator_state_dict)`` (backend_worker.py ``load_decoder``),
  and ``nn.Module.load_state_dict`` fills a module's own parameters before its children's, so
  ``embed_{i}`` is copied first and ``vq_layer_{i}._codebook.embed`` then overwrites the shared
  storage: the value the reference decodes with is ``vq_layer_{i}._codebook.embed``, which is what we
  read. In a file Lightning saved the two are equal (one tensor, two names); a file where they differ
  is logged, and decoded as the reference would.
- ``embed_avg``/``cluster_size``/``inited`` are EMA training state; all must still be present,
  because the reference's load is strict.

Memory: the file is memory-mapped, the model is built on the meta device and materialised empty,
and each weight is filled (weight norm folded) in slices whose source pages are returned to the
OS at once, so the peak stays near the decoder's own size, whatever else the file holds.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import datetime
import logging
import math
import mmap
import pathlib
import pickle
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from songserve.errors import ConfigError

log = logging.getLogger(__name__)

TRUST_SETTING = "TRUST_CHECKPOINT_PICKLE"
_SLICE_BYTES = 16 << 20
_MADV_DONTNEED = 4
_MADV_POPULATE_READ = 22  # Linux ≥ 5.14: map a range's pages in one call instead of one fault each
_MADV_POPULATE_WRITE = 23


def _safe_globals() -> list[Any]:
    """Plain, inert types that Lightning checkpoints carry beside tensors (no code runs on load)."""
    out: list[Any] = [
        collections.OrderedDict,
        collections.Counter,
        collections.deque,
        argparse.Namespace,
        pathlib.PurePosixPath,
        pathlib.PosixPath,
        pathlib.PureWindowsPath,
        datetime.datetime,
        datetime.date,
        datetime.timedelta,
        datetime.timezone,
        set,
        frozenset,
        slice,
        complex,
    ]
    try:  # numpy scalars and small arrays (e.g. a callback's best score); numpy is optional here
        import numpy as np

        core = np._core if hasattr(np, "_core") else np.core  # numpy 2 renamed it; files from numpy 1 say "core"
        for fn in (core.multiarray.scalar, core.multiarray._reconstruct):
            out += [fn, (fn, f"numpy.core.multiarray.{fn.__name__}"), (fn, f"numpy._core.multiarray.{fn.__name__}")]
        out += [np.dtype, np.ndarray]
        out += [type(np.dtype(t)) for t in ("float16", "float32", "float64", "int32", "int64", "bool")]
    except (ImportError, AttributeError):
        pass
    return out


def read_checkpoint(path: Path, *, trust_pickle: bool = False) -> tuple[Any, bool]:
    """Load ``path`` to CPU, memory-mapped where the format allows; returns (object, mapped).

    ``weights_only=True`` with the allow-list above; a file that needs anything else refuses with a
    sentence naming the setting that opts in to full unpickling, unless ``trust_pickle``.
    """
    if not path.is_file():
        raise ConfigError(f"Decoder checkpoint {path} does not exist.")

    def load(weights_only: bool, mapped: bool) -> Any:
        with torch.serialization.safe_globals(_safe_globals()):
            return torch.load(path, map_location="cpu", weights_only=weights_only, mmap=mapped)

    for mapped in (True, False):  # mmap needs the zip format; older files load into memory
        try:
            return load(True, mapped), mapped
        except pickle.UnpicklingError as exc:
            if not trust_pickle:
                reason = _first_reason(str(exc))
                raise ConfigError(
                    f"Decoder checkpoint {path} holds objects beyond plain data and tensors ({reason}); "
                    f"set {TRUST_SETTING}=1 to unpickle it fully, only if you trust the file."
                ) from None
            log.warning("decoder checkpoint %s: full unpickling (%s=1)", path, TRUST_SETTING)
            try:
                return load(False, mapped), mapped
            except RuntimeError as exc2:
                if mapped and "mmap" in str(exc2):
                    continue
                raise ConfigError(f"Decoder checkpoint {path} could not be read: {_first_reason(str(exc2))}") from None
        except RuntimeError as exc:
            if mapped and "mmap" in str(exc):
                continue
            raise ConfigError(f"Decoder checkpoint {path} could not be read: {_first_reason(str(exc))}") from None
        except Exception as exc:  # corrupt files raise assorted types
            raise ConfigError(f"Decoder checkpoint {path} could not be read: {_first_reason(str(exc))}") from None
    raise AssertionError("unreachable")


def _first_reason(text: str) -> str:
    """The informative sentence of torch's long weights-only message."""
    marker = "WeightsUnpickler error:"
    if marker in text:
        text = text.split(marker, 1)[1]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[0].split(". Please")[0].rstrip(".") if lines else "unknown error"


def tensors_of(raw: Any, path: Path) -> dict[str, torch.Tensor]:
    """The generator's tensors, prefix removed, from any of the layouts in the module docstring."""
    if not isinstance(raw, dict):
        raise ConfigError(f"Decoder checkpoint {path} is not a mapping of tensors (got {type(raw).__name__}).")
    sd = raw.get("state_dict", raw)
    if isinstance(sd, dict) and isinstance(sd.get("generator"), dict):
        sd = sd["generator"]
    if not isinstance(sd, dict):
        raise ConfigError(f"Decoder checkpoint {path}: 'state_dict' is not a mapping.")
    tensors = {k: v for k, v in sd.items() if isinstance(k, str) and isinstance(v, torch.Tensor)}
    if any(k.startswith("generator.") for k in tensors):
        return {k[len("generator.") :]: v for k, v in tensors.items() if k.startswith("generator.")}
    return tensors


# ---- mapping the model's parameters onto checkpoint tensors ----------------------------------------


@dataclass(frozen=True)
class Source:
    """Where one model tensor comes from: a plain tensor, or a weight-norm pair (g, v) folded at load."""

    key: str
    plain: torch.Tensor | None = None
    g: torch.Tensor | None = None
    v: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        t = self.plain if self.plain is not None else self.v
        assert t is not None
        return t.shape


_CODEBOOK = re.compile(r"^quantizer\.quantizers\.(\d+)\.codebook\.weight$")
_REF_QUANT = re.compile(
    r"^quantizer\.(?:vq_layer_(\d+)\._codebook\.(embed|embed_avg|cluster_size|inited)|embed_(\d+))$"
)
_REF_PARTS = ("embed", "embed_avg", "cluster_size", "inited")


def plan_sources(
    targets: dict[str, torch.Size], state: dict[str, torch.Tensor], path: Path, config: Path, *, mapped: bool = False
) -> dict[str, Source]:
    """Match every model tensor to its checkpoint source, strictly; refuse with the first problem.

    Only ``decoder.*`` and ``quantizer.*`` are considered (the encoder and everything else in a
    training checkpoint is ignored); among those, a missing or a left-over key refuses.
    """
    pool = {k: v for k, v in state.items() if k.startswith(("decoder.", "quantizer."))}
    # DAC's encoder-side projections live under quantizer.* but are not needed to decode.
    pool = {k: v for k, v in pool.items() if ".in_proj." not in k}
    release = any(_REF_QUANT.match(k) for k in pool)
    used: set[str] = set()
    out: dict[str, Source] = {}

    def missing(key: str) -> ConfigError:
        return ConfigError(f"Decoder checkpoint {path} does not match {config}: it lacks the key 'generator.{key}'.")

    def take(key: str) -> torch.Tensor | None:
        if key in pool:
            used.add(key)
            return pool[key]
        return None

    for name, shape in targets.items():
        m = _CODEBOOK.match(name)
        if m and release:
            i = int(m.group(1))
            for part in _REF_PARTS:
                if f"quantizer.vq_layer_{i}._codebook.{part}" not in pool:
                    raise missing(f"quantizer.vq_layer_{i}._codebook.{part}")
            if f"quantizer.embed_{i}" not in pool:
                raise missing(f"quantizer.embed_{i}")
            used.update({f"quantizer.vq_layer_{i}._codebook.{p}" for p in _REF_PARTS} | {f"quantizer.embed_{i}"})
            src = Source(
                f"quantizer.vq_layer_{i}._codebook.embed", plain=pool[f"quantizer.vq_layer_{i}._codebook.embed"]
            )
        else:
            base = name[: -len(".weight")] if name.endswith(".weight") else None
            plain = take(name)
            if plain is not None:
                src = Source(name, plain=plain)
            elif base and f"{base}.weight_v" in pool:
                g, v = take(f"{base}.weight_g"), take(f"{base}.weight_v")
                if g is None:
                    raise missing(f"{base}.weight_g")
                src = Source(f"{base}.weight_v", g=g, v=v)
            elif base and f"{base}.parametrizations.weight.original1" in pool:
                g = take(f"{base}.parametrizations.weight.original0")
                v = take(f"{base}.parametrizations.weight.original1")
                if g is None:
                    raise missing(f"{base}.parametrizations.weight.original0")
                src = Source(f"{base}.parametrizations.weight.original1", g=g, v=v)
            else:
                raise missing(f"{base}.weight_v" if base and name.startswith("decoder.") and len(shape) == 3 else name)
        if src.shape != shape:
            raise ConfigError(
                f"Decoder checkpoint {path} does not match {config}: 'generator.{src.key}' has shape "
                f"{tuple(src.shape)}, the config needs {tuple(shape)}."
            )
        if src.g is not None and src.g.numel() != shape[0]:
            raise ConfigError(
                f"Decoder checkpoint {path} does not match {config}: the weight-norm scale of "
                f"'generator.{src.key}' has {src.g.numel()} entries, {shape[0]} needed."
            )
        out[name] = src
    extra = sorted(set(pool) - used)
    if extra:
        raise ConfigError(
            f"Decoder checkpoint {path} does not match {config}: it has the key 'generator.{extra[0]}', "
            f"which the config does not use ({len(extra)} such keys)."
        )
    if release:
        _warn_if_embed_differs(pool, sum(1 for n in targets if _CODEBOOK.match(n)), path, mapped)
    return out


def _warn_if_embed_differs(pool: dict[str, torch.Tensor], n: int, path: Path, mapped: bool) -> None:
    for i in range(n):
        a, b = pool[f"quantizer.vq_layer_{i}._codebook.embed"], pool[f"quantizer.embed_{i}"]
        same = a.shape == b.shape and torch.equal(a, b)
        if mapped:
            _drop_pages(a)
            _drop_pages(b)
        if not same:
            log.warning(
                "decoder checkpoint %s: quantizer.embed_%d differs from vq_layer_%d._codebook.embed; "
                "decoding with _codebook.embed (the EMA codebook the reference's VQ layers decode with)",
                path,
                i,
                i,
            )
            return


# ---- filling parameters slice by slice ---------------------------------------------------------------


def _slices(rows: int, row_bytes: int) -> Iterator[slice]:
    step = max(1, _SLICE_BYTES // max(1, row_bytes))
    for a in range(0, rows, step):
        yield slice(a, min(rows, a + step))


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    try:
        fn = ctypes.CDLL("libc.so.6", use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _libc_madvise()


def _advise(t: torch.Tensor, advice: int, align: int = mmap.PAGESIZE) -> None:
    """madvise() the whole ``align``-sized pages under a contiguous CPU tensor (errors are ignored:
    every use here is an optimisation, and older kernels lack some advice values)."""
    if _MADVISE is None or t.device.type != "cpu" or not t.is_contiguous():
        return
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    lo, hi = math.ceil(start / align) * align, (end // align) * align
    if hi > lo:
        _MADVISE(lo, hi - lo, advice)


def _drop_pages(t: torch.Tensor) -> None:
    """Give back the pages under ``t`` of a private, read-only file mapping (they re-read from the
    file if touched again), so a large checkpoint never sits in memory beside the model."""
    _advise(t, _MADV_DONTNEED)


def prepare_destination(t: torch.Tensor) -> None:
    """Map a freshly allocated weight's pages in one call rather than one fault per page when filled."""
    _advise(t, _MADV_POPULATE_WRITE)


@torch.no_grad()
def fill(dest: torch.Tensor, src: Source, *, mapped: bool) -> None:
    """Write ``src`` into ``dest`` (weight norm g · v / ‖v‖ folded, norm over all dims but the first)."""
    rows = dest.shape[0] if dest.dim() else 1
    row_bytes = max(1, (dest.numel() // max(1, rows)) * 4)
    if src.plain is not None:
        s = src.plain
        if dest.dim() == 0:
            dest.copy_(s)
            return
        for sl in _slices(rows, row_bytes):
            if mapped:
                _advise(s[sl], _MADV_POPULATE_READ)
            dest[sl].copy_(s[sl])
            if mapped:
                _drop_pages(s[sl])
        return
    assert src.g is not None
    assert src.v is not None
    g = src.g.reshape(-1).float()
    for sl in _slices(rows, row_bytes):
        if mapped:
            _advise(src.v[sl], _MADV_POPULATE_READ)
        v = src.v[sl].float()
        scale = (g[sl] / v.flatten(1).norm(dim=1)).view(-1, *([1] * (v.dim() - 1)))
        if dest.dtype == v.dtype and dest.device == v.device:
            torch.mul(v, scale, out=dest[sl])  # one pass, no temporary
        else:
            dest[sl].copy_(v * scale)
        if mapped:
            _drop_pages(src.v[sl])
