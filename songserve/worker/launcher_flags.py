"""What the worker does with each flag the reference launcher and its worker know.

The reference launcher (``backend/run_backend.sh`` of Khala-Music-AI/Khala) starts each worker as
``backend_worker.py --worker-port P --runtime-mode M --seed S`` followed by its ``MEGATRON_ARGS``;
the reference worker parses them with its ``add_worker_args``, which adds Megatron's
``add_common_inference_args`` (``examples/inference/gpt/utils.py``). Every one of those flags, met
in ``MEGATRON_ARGS`` or on the worker's command line, gets exactly one start-up line here, and the
line is true:

- ``applied``: it changes what this worker does (the token budget, the KV-cache context, the batch
  size, an architecture field of the checkpoint);
- ``not needed``: this worker already behaves that way, or the flag only tunes something it does
  not have (the reference's one-shot subprocesses, Megatron's example-script options);
- ``refused``: honouring it is impossible here and ignoring it would compute something else (a
  parallel size above 1, fp16, a Mamba model): start-up stops with that line.

A flag outside these lists is said to be ignored, at warning level. ``--num-tokens-to-generate``
and ``--max-batch-size`` / ``--inference-max-requests`` set ``MAX_NEW_TOKENS`` / ``MAX_BATCH``
unless those are set explicitly (environment or the worker's own flag), which then win; the
start-up line says which value is in force and where it came from.

``pipeline.megatron_args`` (which imports torch) is imported only where there are flags to judge:
a test-tone worker started without Megatron flags never loads torch.
"""

from __future__ import annotations

import logging
from typing import Any

from songserve.errors import ConfigError
from songserve.worker.settings import WorkerSettings

log = logging.getLogger(__name__)

APPLIED, NOT_NEEDED, REFUSED = "applied", "not needed", "refused"

_CHILD = ("child_once", "child_stage", "artifact_dir", "request_json", "result_json", "status_json")
_EXAMPLES = (  # add_common_inference_args options of Megatron's example scripts; the reference never reads them
    "return_log_probs",
    "prompts",
    "num_tokens_to_prompt",
    "top_n_logprobs",
    "incoming_requests_per_step",
    "incoming_requests_per_sec",
    "incoming_requests_duration",
    "output_path",
    "output_every_n_results",
    "prompt_file",
    "prompt_file_num_truncate",
    "inference_coordinator_port",
)
_FIXED: dict[str, tuple[str, str]] = {
    "stream": (NOT_NEEDED, "progress is always reported through /health while a track runs"),
    "enable_cuda_graph": (NOT_NEEDED, "on CUDA the decode step runs in CUDA graphs by default (COMPILE=auto)"),
    "flash_decode": (NOT_NEEDED, "attention runs through torch's scaled_dot_product_attention"),
    "bf16": (NOT_NEEDED, "on CUDA the models run in bf16 by default; the CPU computes in fp32"),
    "fp16": (REFUSED, "this worker computes in bf16 on CUDA and fp32 on the CPU; drop --fp16"),
    "tokenizer_type": (NOT_NEEDED, "the tokenizer is read from the tokenizer folder (TOKENIZER_PATH)"),
    "tokenizer_model": (NOT_NEEDED, "the tokenizer is read from the tokenizer folder (TOKENIZER_PATH)"),
    "use_checkpoint_args": (NOT_NEEDED, "always on: the architecture comes from the checkpoint's saved args"),
    "load": (NOT_NEEDED, "model paths come from CHECKPOINTS_DIR / BACKBONE_MODELS / SUPERRES_MODELS"),
    "micro_batch_size": (NOT_NEEDED, "a batch is the takes of one request (MAX_BATCH)"),
    "seed": (NOT_NEEDED, "the worker's SEED (--seed on its command line) seeds requests"),
    "no_load_optim": (NOT_NEEDED, "optimizer state is never loaded"),
    "no_load_rng": (NOT_NEEDED, "RNG state is never loaded"),
    "temperature": (NOT_NEEDED, "each request carries its own temperature, as in the reference"),
    "top_k": (NOT_NEEDED, "each request carries its own top-k, as in the reference"),
    "top_p": (NOT_NEEDED, "the reference samples with temperature and top-k only, and so does this worker"),
    **{
        k: (NOT_NEEDED, "the reference's internal one-shot subprocess flag; stages load in this process")
        for k in _CHILD
    },
    **{
        k: (NOT_NEEDED, "an option of Megatron's inference examples, unused by the reference's worker")
        for k in _EXAMPLES
    },
}
_SETTING_FLAGS = {  # flag → the worker setting it feeds when that setting is not set explicitly
    "num_tokens_to_generate": "max_new_tokens",
    "max_batch_size": "max_batch",
    "inference_max_requests": "max_batch",
}


def flag_name(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def verdict(dest: str, value: Any, explicit: set[str]) -> tuple[str, str]:
    """(applied | not needed | refused | ignored, why) for one flag."""
    from songserve.pipeline.checkpoints.megatron_args import ARCH_KEYS, PARALLEL, unsupported_use

    if dest in PARALLEL:
        if value in (1, None):
            return NOT_NEEDED, "one GPU per worker: 1 is the only size"
        return REFUSED, f"{flag_name(dest)} {value} is not supported (one GPU per worker)"
    if dest == "model_provider":
        if value == "gpt":
            return NOT_NEEDED, "the worker serves GPT models"
        return REFUSED, f"--model-provider {value} is not supported: the worker serves GPT models only"
    why = unsupported_use(dest, value)
    if why:
        return REFUSED, why
    if dest in _SETTING_FLAGS:
        setting = _SETTING_FLAGS[dest]
        if setting in explicit:
            return NOT_NEEDED, f"{setting.upper()} is set explicitly and wins"
        return APPLIED, f"sets {setting.upper()}"
    if dest == "inference_max_seq_length":
        return APPLIED, "bounds the backbone's context (positions per track, KV cache)"
    if dest in _FIXED:
        return _FIXED[dest]
    if dest in ARCH_KEYS:
        return APPLIED, f"overrides the checkpoint's saved {dest}"
    return "ignored", "not a setting this worker reads"


def _as_int(dest: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(f"Launcher flag {flag_name(dest)}: must be an integer from {lo} to {hi} (got {value!r}).")
    return value


def apply_launcher_flags(s: WorkerSettings) -> WorkerSettings:
    """Log one line per flag of ``s.megatron_args``, refuse the impossible ones, and return the
    settings with the flags that feed a setting applied (an explicit setting wins)."""
    flags: dict[str, Any] = {}
    if s.megatron_args.strip():
        from songserve.pipeline.checkpoints.megatron_args import parse_flags

        flags = parse_flags(s.megatron_args)
    explicit = set(s.model_fields_set)
    updates: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for dest, value in flags.items():
        word, why = verdict(dest, value, explicit)
        line = f"launcher flag {flag_name(dest)} {value}: {word}: {why}"
        if word == REFUSED:
            raise ConfigError(line + ".")
        (log.warning if word == "ignored" else log.info)("%s", line)
        setting = _SETTING_FLAGS.get(dest)
        if word == APPLIED and setting:
            lo, hi = (1, 64) if setting == "max_batch" else (2, 10_000_000)
            updates[setting] = _as_int(dest, value, lo, hi)
            origin[setting] = f"from the launcher flag {flag_name(dest)}"
    for setting in ("max_new_tokens", "max_batch"):
        origin.setdefault(setting, f"{setting.upper()} set explicitly" if setting in explicit else "the default")
    out = s.model_copy(update=updates) if updates else s
    log.info("backbone token budget: %d new tokens (%s)", out.max_new_tokens, origin["max_new_tokens"])
    log.info("batch size: at most %d takes of one request (%s)", out.max_batch, origin["max_batch"])
    return out
