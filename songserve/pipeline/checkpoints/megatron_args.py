"""Megatron-LM's saved ``args``: read them safely, apply flag overrides, map them onto ``GPTArch``.

The published checkpoints carry their architecture inside the checkpoint, not in a side file:
Megatron-LM pickles its ``argparse.Namespace`` into ``common.pt`` (torch_dist) or
``mp_rank_00/model_optim_rng.pt`` (legacy), and the reference loads it with
``--use-checkpoint-args``. We unpickle with ``weights_only=True`` and an allow-list of the few
non-tensor types those files carry (``Namespace``, megatron's enums), so a checkpoint cannot run
code on load.

Every field that changes the computation is either mapped onto megatron-core's config or refuses
start-up with one line naming it: a worker must never silently compute something else than the
model was trained to compute. What the worker does with each of the reference launcher's flags is
``songserve/worker/launcher_flags.py``.

How the text vocabulary T is derived for the release: Megatron-LM with ``NullTokenizer`` saves
``vocab_size`` = the model's real vocabulary (backbone 130,304, superres 193,792) and
``padded_vocab_size`` = (vocab_size + 1) rounded up to a multiple of 128 (130,432 / 193,920).
T = vocab_size − levels × 1024 with levels 2 (backbone: q0, q1) or 64 (superres): 128,256 for both.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import logging
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from songserve.errors import ConfigError
from songserve.pipeline.numbers import CODEBOOK, LEVELS

log = logging.getLogger(__name__)

DEFAULT_PROMPT = {"backbone": 4096, "superres": 2048}

# Megatron flags that are switches (no value); ``--disable-*``/``--no-*`` ones clear a field.
_SWITCH_OFF = {
    "disable_bias_linear": "add_bias_linear",
    "no_position_embedding": "add_position_embedding",
    "no_rope_fusion": "apply_rope_fusion",
    "no_masked_softmax_fusion": "masked_softmax_fusion",
    "no_bias_swiglu_fusion": "bias_swiglu_fusion",
    "no_bias_gelu_fusion": "bias_gelu_fusion",
    "no_bias_dropout_fusion": "bias_dropout_fusion",
    "no_persist_layer_norm": "persist_layer_norm",
    "no_load_optim": "no_load_optim",
    "no_load_rng": "no_load_rng",
}

PARALLEL = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
)

# Math-changing fields the worker does not implement: (field, "is it in use?").
_UNSUPPORTED: tuple[tuple[str, Any], ...] = (
    ("num_experts", lambda v: v not in (None, 0, 1)),
    ("multi_latent_attention", bool),
    ("apply_residual_connection_post_layernorm", bool),
    ("window_size", lambda v: v is not None),
    ("openai_gelu", bool),
    ("qk_l2_norm", bool),
    ("attention_output_gate", bool),
    ("softmax_type", lambda v: v not in (None, "vanilla")),
    ("no_rope_freq", lambda v: v is not None),
    ("heterogeneous_layers_config_path", bool),
    ("experimental_attention_variant", bool),
    ("linear_attention_type", bool),
    ("hybrid_override_pattern", bool),
    ("position_embedding_type", lambda v: v not in (None, "rope", "learned_absolute", "none")),
    ("normalization", lambda v: v not in (None, "LayerNorm", "RMSNorm")),
)


# ---- reading -----------------------------------------------------------------------------------


def _allowed_types() -> list[Any]:
    """The plain non-tensor types Megatron-LM checkpoints pickle: its Namespace and enums."""
    from megatron.core.transformer import enums

    allowed: list[Any] = [argparse.Namespace]
    allowed += [v for v in vars(enums).values() if isinstance(v, type) and issubclass(v, enum.Enum)]
    try:  # legacy files keep numpy's RNG state beside the weights
        import numpy as np

        allowed += [np.core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]  # type: ignore[attr-defined]
    except (ImportError, AttributeError):
        pass
    return allowed


@contextlib.contextmanager
def safe_unpickling() -> Iterator[None]:
    """``torch.load(weights_only=True)`` with Megatron's Namespace and enums allowed, nothing else."""
    with torch.serialization.safe_globals(_allowed_types()):
        yield


def safe_load(path: Path, **kwargs: Any) -> Any:
    """Load a Megatron file without running code; a file that needs more refuses with its path."""
    try:
        with safe_unpickling():
            return torch.load(path, map_location="cpu", weights_only=True, **kwargs)
    except Exception as exc:  # pickle.UnpicklingError and friends
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"Checkpoint file {path} could not be read safely: {first}") from None


def read_saved_args(it_dir: Path) -> dict[str, Any] | None:
    """``vars(args)`` from ``common.pt`` or ``mp_rank_00/model_optim_rng.pt``; None when absent."""
    for f in (it_dir / "common.pt", it_dir / "mp_rank_00" / "model_optim_rng.pt"):
        if f.is_file():
            obj = safe_load(f, mmap=f.name != "common.pt")
            args = obj.get("args") if isinstance(obj, dict) else None
            if isinstance(args, argparse.Namespace):
                return dict(vars(args))
            return None
    return None


# ---- flag overrides ----------------------------------------------------------------------------


def _coerce(text: str) -> Any:
    for typ in (int, float):
        try:
            return typ(text)
        except ValueError:
            pass
    return {"None": None, "True": True, "False": False}.get(text, text)


def parse_flags(text: str | list[str]) -> dict[str, Any]:
    """Megatron-style flags → {dest: value}: ``--a-b 3`` → a_b=3, ``--swiglu`` → swiglu=True.

    Megatron-LM has hundreds of flags; parsing them generically keeps every one of them usable as
    an override of the saved args, and the unknown ones reach the log instead of an error.
    """
    try:
        tokens = shlex.split(text) if isinstance(text, str) else list(text)
    except ValueError as exc:
        raise ConfigError(f"MEGATRON_ARGS could not be parsed: {exc}.") from None
    out: dict[str, Any] = {}
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if not tok.startswith("--") or len(tok) == 2:
            raise ConfigError(f"MEGATRON_ARGS: {tok!r} is not a --flag.")
        name, eq, value = tok[2:].partition("=")
        dest = name.replace("-", "_")
        values = []
        while not eq and i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            i += 1
            values.append(_coerce(tokens[i]))  # nargs="+" flags (--prompts a b) keep every value
        if eq:
            out[dest] = _coerce(value)
        elif values:
            out[dest] = values[0] if len(values) == 1 else values
        elif dest in _SWITCH_OFF:
            out[_SWITCH_OFF[dest]] = _SWITCH_OFF[dest] == dest  # --no-load-optim names itself
        else:
            out[dest] = True
        i += 1
    return out


def check_parallel(flags: dict[str, Any], source: str) -> None:
    """Refuse parallel sizes above 1: a worker owns one GPU."""
    for k in PARALLEL:
        if k in flags and flags[k] not in (1, None):
            raise ConfigError(f"{source}: --{k.replace('_', '-')} {flags[k]} is not supported (one GPU per worker).")


# ---- mapping -----------------------------------------------------------------------------------

ARCH_KEYS = {  # the saved args that map onto the architecture (or refuse)
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "group_query_attention",
    "num_query_groups",
    "kv_channels",
    "max_position_embeddings",
    "seq_length",
    "position_embedding_type",
    "use_rotary_position_embeddings",
    "rotary_base",
    "rotary_percent",
    "rotary_interleaved",
    "rotary_seq_len_interpolation_factor",
    "use_rope_scaling",
    "rope_scaling_factor",
    "normalization",
    "norm_epsilon",
    "apply_layernorm_1p",
    "qk_layernorm",
    "swiglu",
    "squared_relu",
    "add_bias_linear",
    "add_qkv_bias",
    "untie_embeddings_and_output_weights",
    "vocab_size",
    "padded_vocab_size",
    "make_vocab_size_divisible_by",
} | {k for k, _ in _UNSUPPORTED}


def unsupported_use(field: str, value: Any) -> str | None:
    """Why ``field=value`` cannot be served (it changes the math in a way this worker lacks), or None."""
    for name, in_use in _UNSUPPORTED:
        if name == field and value is not None and in_use(value):
            return f"{field}={value!r} changes the model's math and is not supported by this worker"
    return None


def _check_supported(a: dict[str, Any], source: str) -> None:
    for field, _ in _UNSUPPORTED:
        why = unsupported_use(field, a.get(field))
        if why:
            raise ConfigError(f"{source}: {why}.")


def arch_fields_from_args(kind: str, a: dict[str, Any], source: str) -> dict[str, Any]:
    """Saved (and overridden) Megatron args → ``GPTArch`` keyword arguments."""
    if kind not in LEVELS:
        raise ConfigError(f"{source}: unknown model kind {kind!r}.")
    _check_supported(a, source)

    def req(name: str) -> Any:
        if a.get(name) is None:
            raise ConfigError(f"{source}: the saved args have no {name!r}; pass --{name.replace('_', '-')} N.")
        return a[name]

    heads = int(req("num_attention_heads"))
    vocab = int(req("vocab_size"))
    padded = int(a.get("padded_vocab_size") or vocab)
    if padded < vocab:
        raise ConfigError(f"{source}: padded_vocab_size {padded} is smaller than vocab_size {vocab}.")
    levels = LEVELS[kind]
    text = vocab - levels * CODEBOOK
    if text <= 0:
        raise ConfigError(
            f"{source}: vocab_size {vocab} leaves no text vocabulary for {levels} codebooks of {CODEBOOK}."
        )
    max_seq = a.get("max_position_embeddings") or req("seq_length")
    pos = a.get("position_embedding_type")
    if pos is None:
        pos = "rope" if a.get("use_rotary_position_embeddings") else "learned_absolute"
    if a.get("squared_relu") and a.get("swiglu"):
        raise ConfigError(f"{source}: swiglu and squared_relu are both set.")
    activation = "silu" if a.get("swiglu") else "squared_relu" if a.get("squared_relu") else "gelu"
    fields: dict[str, Any] = {
        "kind": kind,
        "num_layers": int(req("num_layers")),
        "hidden_size": int(req("hidden_size")),
        "num_attention_heads": heads,
        "ffn_hidden_size": int(req("ffn_hidden_size")),
        "text_vocab_size": text,
        "vocab_size": vocab,
        "padded_vocab_size": padded,
        "max_sequence_length": int(max_seq),
        "max_prompt_length": min(DEFAULT_PROMPT[kind], int(max_seq) // 2),
        "num_query_groups": int(a["num_query_groups"]) if a.get("group_query_attention") else None,
        "kv_channels": int(a["kv_channels"]) if a.get("kv_channels") else None,
        "normalization": a.get("normalization") or "LayerNorm",
        "norm_epsilon": float(a.get("norm_epsilon") or 1e-5),
        "layernorm_zero_centered_gamma": bool(a.get("apply_layernorm_1p")),
        "qk_layernorm": bool(a.get("qk_layernorm")),
        "position_embedding_type": pos,
        "rotary_base": int(a.get("rotary_base") or 10000),
        "rotary_percent": float(a.get("rotary_percent") or 1.0),
        "rotary_interleaved": bool(a.get("rotary_interleaved")),
        "rotary_interpolation_factor": a.get("rotary_seq_len_interpolation_factor"),
        "rope_scaling": bool(a.get("use_rope_scaling")),
        "rope_scaling_factor": float(a.get("rope_scaling_factor") or 8.0),
        "gated_linear_unit": bool(a.get("swiglu")),
        "activation": activation,
        "add_bias_linear": bool(a.get("add_bias_linear", True)),
        "add_qkv_bias": bool(a.get("add_qkv_bias")),
        "share_embeddings_and_output_weights": not a.get("untie_embeddings_and_output_weights", False),
    }
    if a.get("inference_max_seq_length") is not None:
        fields["inference_max_seq_length"] = int(a["inference_max_seq_length"])
    return fields


# Our arch field names → Megatron flag names, for ``parse_megatron_args`` on model_config.json sets.
_FLAG_TO_ARCH = {
    "num_layers": "num_layers",
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_attention_heads",
    "ffn_hidden_size": "ffn_hidden_size",
    "num_query_groups": "num_query_groups",
    "seq_length": "max_sequence_length",
    "max_position_embeddings": "max_sequence_length",
    "normalization": "normalization",
    "position_embedding_type": "position_embedding_type",
    "kv_channels": "kv_channels",
    "norm_epsilon": "norm_epsilon",
    "rotary_base": "rotary_base",
    "rotary_percent": "rotary_percent",
    "rotary_interleaved": "rotary_interleaved",
    "apply_layernorm_1p": "layernorm_zero_centered_gamma",
    "qk_layernorm": "qk_layernorm",
    "add_bias_linear": "add_bias_linear",
    "add_qkv_bias": "add_qkv_bias",
    "swiglu": "gated_linear_unit",
    "inference_max_seq_length": "inference_max_seq_length",
}


def flags_to_arch_overrides(flags: dict[str, Any], source: str = "MEGATRON_ARGS") -> dict[str, Any]:
    """Flags over a ``model_config.json`` set: the arch fields they name (math-changing unknowns refuse)."""
    _check_supported(flags, source)
    out = {_FLAG_TO_ARCH[k]: v for k, v in flags.items() if k in _FLAG_TO_ARCH}
    if flags.get("untie_embeddings_and_output_weights"):
        out["share_embeddings_and_output_weights"] = False
    return out
