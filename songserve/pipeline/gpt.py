"""A megatron-core ``GPTModel`` as both acoustic models use it.

What differs from a text GPT (shared/docs/model.md):
- the input at a position is a row of codebook columns, ``[B, S, C]`` with ``-1`` as padding, and
  its embedding is the sum of the columns' embeddings (``C = 1`` for the backbone);
- the caller projects hidden states onto a slice of the output matrix (one codebook's 1,024 rows),
  never the whole vocabulary, so the model runs with its output layer switched off.

Checkpoints are Megatron-LM directories: ``latest_checkpointed_iteration.txt`` and ``iter_N/``
holding either a ``torch_dist`` checkpoint (what the tiny builder writes) or a legacy
``mp_rank_00/model_optim_rng.pt``; the architecture comes from ``model_config.json`` beside them,
overridden by ``MEGATRON_ARGS``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from songserve.errors import ConfigError

if TYPE_CHECKING:
    from megatron.core.inference.contexts import StaticInferenceContext

log = logging.getLogger(__name__)

MODEL_CONFIG = "model_config.json"
TRACKER = "latest_checkpointed_iteration.txt"


@dataclass(frozen=True)
class GPTArch:
    kind: str  # "backbone" or "superres"
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    text_vocab_size: int  # T: audio ids start here
    vocab_size: int  # backbone T + 2·1024, superres T + 64·1024
    max_sequence_length: int
    max_prompt_length: int
    num_query_groups: int | None = None
    normalization: str = "LayerNorm"
    position_embedding_type: str = "learned_absolute"
    gated_linear_unit: bool = False
    share_embeddings_and_output_weights: bool = False

    @classmethod
    def from_dir(cls, path: Path, megatron_args: str = "") -> GPTArch:
        cfg_file = path / MODEL_CONFIG
        try:
            raw = json.loads(cfg_file.read_text())
        except FileNotFoundError:
            raise ConfigError(f"Checkpoint {path} has no {MODEL_CONFIG}.") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{cfg_file} is not valid JSON: {exc}.") from None
        raw.update(parse_megatron_args(megatron_args))
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(raw) - names
        if unknown:
            raise ConfigError(f"{cfg_file} has unknown keys: {', '.join(sorted(unknown))}.")
        try:
            return cls(**raw)
        except TypeError as exc:
            raise ConfigError(f"{cfg_file} is incomplete: {exc}.") from None


_ARG_MAP = {
    "--num-layers": ("num_layers", int),
    "--hidden-size": ("hidden_size", int),
    "--num-attention-heads": ("num_attention_heads", int),
    "--ffn-hidden-size": ("ffn_hidden_size", int),
    "--num-query-groups": ("num_query_groups", int),
    "--seq-length": ("max_sequence_length", int),
    "--max-position-embeddings": ("max_sequence_length", int),
    "--normalization": ("normalization", str),
    "--position-embedding-type": ("position_embedding_type", str),
}


def parse_megatron_args(text: str) -> dict[str, object]:
    """The subset of Megatron-LM's flags that shape the model; other flags are logged and ignored."""
    if not text.strip():
        return {}
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    for flag, (dest, typ) in _ARG_MAP.items():
        parser.add_argument(flag, dest=dest, type=typ)
    parser.add_argument("--swiglu", dest="gated_linear_unit", action="store_true", default=None)
    parser.add_argument("--untie-embeddings-and-output-weights", dest="untie", action="store_true", default=None)
    try:
        ns, rest = parser.parse_known_args(shlex.split(text))
    except (argparse.ArgumentError, ValueError) as exc:
        raise ConfigError(f"MEGATRON_ARGS could not be parsed: {exc}.") from None
    if rest:
        log.warning("MEGATRON_ARGS: ignoring %s", " ".join(rest))
    out = {k: v for k, v in vars(ns).items() if v is not None and k != "untie"}
    if ns.untie:
        out["share_embeddings_and_output_weights"] = False
    return out


def build_model(arch: GPTArch, device: torch.device, dtype: torch.dtype) -> Any:
    """Build the GPTModel (local layer spec: no transformer-engine or apex) in eval mode."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        ffn_hidden_size=arch.ffn_hidden_size,
        normalization=arch.normalization,
        gated_linear_unit=arch.gated_linear_unit,
        use_cpu_initialization=True,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        cuda_graph_scope=[],
    )
    from songserve.pipeline.attention import SdpaDotProductAttention

    spec = get_gpt_layer_local_spec(normalization=arch.normalization)
    spec.submodules.self_attention.submodules.core_attention = SdpaDotProductAttention
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_sequence_length,
        position_embedding_type=arch.position_embedding_type,
        share_embeddings_and_output_weights=arch.share_embeddings_and_output_weights,
    )
    return model.to(device).eval()


class AcousticGPT:
    """A loaded GPTModel driven with summed-column embeddings and sliced output projections."""

    def __init__(self, arch: GPTArch, model: Any) -> None:
        self.arch = arch
        self.model: Any = model  # megatron's GPTModel: submodules are dynamic attributes
        # Hidden states out: _postprocess returns before the output layer when post_process is
        # off; the final layer norm stays (it belongs to the decoder block).
        model.post_process = False
        if arch.share_embeddings_and_output_weights:
            self.output_weight = model.shared_embedding_or_output_weight()
        else:
            self.output_weight = model.output_layer.weight  # (V, H)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype

    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """ids (B, S, C), -1 = padding; positions (B, S) → decoder input (S, B, H)."""
        emb = self.model.embedding
        table = emb.word_embeddings.weight
        if ids.shape[2] == 1 and bool((ids >= 0).all()):  # the backbone's case: one column, no padding
            x = torch.nn.functional.embedding(ids[:, :, 0], table)
        else:
            x = torch.zeros(*ids.shape[:2], table.shape[1], dtype=table.dtype, device=table.device)
            for c in range(ids.shape[2]):  # column by column: bounded memory for 64 columns
                col = ids[:, :, c]
                present = (col >= 0).unsqueeze(-1).to(table.dtype)
                x += torch.nn.functional.embedding(col.clamp(min=0), table) * present
        if getattr(emb, "add_position_embedding", False):
            x = x + emb.position_embeddings(positions)
        return x.transpose(0, 1).contiguous()

    def hidden(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        attention_mask: torch.Tensor | None,
        context: StaticInferenceContext | None = None,
    ) -> torch.Tensor:
        """Run the transformer; returns hidden states (S, B, H) after the final layer norm."""
        out = self.model(
            input_ids=None,
            position_ids=positions,
            attention_mask=attention_mask,
            decoder_input=self.embed(ids, positions),
            inference_context=context,
            runtime_gather_output=True,
        )
        return out

    def project(self, hidden: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Logits over output rows [start, stop) only: (..., H) → (..., stop - start)."""
        return hidden @ self.output_weight[start:stop].t()

    def new_kv_context(self, max_len: int, batch: int = 1) -> StaticInferenceContext:
        """A static KV cache with its buffers allocated here, on the model's device (5.)."""
        from megatron.core.inference.contexts import StaticInferenceContext

        ctx = StaticInferenceContext(batch, max_len)
        for layer in self.model.decoder.layers:
            att = layer.self_attention
            shape = (max_len, batch, att.num_query_groups_per_partition, att.key_hidden_size)
            ctx.key_value_memory_dict[att.layer_number] = (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape[:-1] + (att.val_hidden_size,), dtype=self.dtype, device=self.device),
            )
        return ctx


def causal_mask(n: int, device: torch.device) -> torch.Tensor:
    """Explicit prefill mask, True = masked (megatron would build its default on CUDA: 3.)."""
    return torch.ones(n, n, dtype=torch.bool, device=device).triu(1).view(1, 1, n, n)


def full_mask(n: int, device: torch.device) -> torch.Tensor:
    """Non-causal: every position sees every position (the grids carry no padding rows)."""
    return torch.zeros(1, 1, n, n, dtype=torch.bool, device=device)


# ---- checkpoints -------------------------------------------------------------------------------


def _iteration_dir(path: Path) -> Path:
    tracker = path / TRACKER
    if not tracker.is_file():
        return path
    it = tracker.read_text().strip()
    return path / ("release" if it == "release" else f"iter_{int(it):07d}")


def save_checkpoint(path: Path, arch: GPTArch, model: Any, iteration: int = 1) -> None:
    """Write a Megatron-LM style torch_dist checkpoint plus ``model_config.json``."""
    from megatron.core import dist_checkpointing

    from songserve.pipeline.megatron_env import cpu_checkpoint_io

    it_dir = path / f"iter_{iteration:07d}"
    it_dir.mkdir(parents=True, exist_ok=True)
    with cpu_checkpoint_io():
        dist_checkpointing.save({"model": model.sharded_state_dict()}, str(it_dir))
    (path / TRACKER).write_text(str(iteration))
    (path / MODEL_CONFIG).write_text(json.dumps(dataclasses.asdict(arch), indent=2) + "\n")


def load_model(path: Path, device: torch.device, dtype: torch.dtype, megatron_args: str = "") -> AcousticGPT:
    """Build the model from the directory's config and load its weights with strict key checks."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    if not path.is_dir():
        raise ConfigError(f"Checkpoint directory {path} does not exist.")
    arch = GPTArch.from_dir(path, megatron_args)
    it_dir = _iteration_dir(path)
    model = build_model(arch, device, dtype)
    legacy = it_dir / "mp_rank_00" / "model_optim_rng.pt"
    try:
        if (it_dir / ".metadata").is_file():
            loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(it_dir))
            state = loaded["model"]
        elif legacy.is_file():
            # Operator-provided Megatron-LM files pickle their args; they are trusted like code.
            state = torch.load(legacy, map_location=device, weights_only=False)["model"]
        else:
            raise ConfigError(f"Checkpoint {it_dir} holds neither a torch_dist checkpoint nor {legacy.name}.")
        state = {k: v for k, v in state.items() if not k.endswith("_extra_state")}
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
    except ConfigError:
        raise
    except (Exception, CheckpointException) as exc:  # many types; torch's is a BaseException
        reason = [ln for ln in str(exc).splitlines() if ln.strip()][-1:] or [type(exc).__name__]
        raise ConfigError(f"Checkpoint {path} does not match its model config: {reason[0].strip()}") from None
    if missing or unexpected:
        raise ConfigError(
            f"Checkpoint {path} does not match its model config: missing {missing[:3]}, unexpected {unexpected[:3]}."
        )
    return AcousticGPT(arch, model.to(device=device, dtype=dtype))
