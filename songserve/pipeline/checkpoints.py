"""Which files make up the checkpoint set, from the reference's settings, validated at start-up.

With nothing configured the worker uses the tiny set in ``checkpoints/tiny`` and builds it once.
Any configured path that is missing refuses start-up with one line naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from songserve.errors import ConfigError
from songserve.settings import DEFAULT_TINY_DIR, WorkerSettings, parse_model_map

DEFAULT_BACKBONE = "default_backbone"
DEFAULT_SUPERRES = "default_superres"


@dataclass(frozen=True)
class CheckpointSet:
    tokenizer: Path
    backbones: dict[str, Path]
    superres: dict[str, Path]
    decoder_config: Path
    decoder_checkpoint: Path
    tiny: bool


def _configured(s: WorkerSettings) -> bool:
    return any(
        (
            s.checkpoints_dir,
            s.tokenizer_path,
            s.backbone_models,
            s.superres_models,
            s.decoder_config_path,
            s.decoder_checkpoint_path,
        )
    )


def resolve(s: WorkerSettings) -> CheckpointSet:
    """Paths of the set; builds the tiny set when nothing is configured."""
    tiny = not _configured(s)
    if tiny:
        from songserve.pipeline.tiny import ensure_tiny_set

        ensure_tiny_set(DEFAULT_TINY_DIR)
    base = s.checkpoints_dir or DEFAULT_TINY_DIR
    if not base.is_dir() and s.checkpoints_dir is not None:
        raise ConfigError(f"CHECKPOINTS_DIR {base} does not exist.")

    def under(p: Path | str) -> Path:
        p = Path(p)
        return p if p.is_absolute() else base / p

    ckpt = CheckpointSet(
        tokenizer=under(s.tokenizer_path or "tokenizer"),
        backbones={
            k: under(v)
            for k, v in (
                parse_model_map(s.backbone_models, "BACKBONE_MODELS") or {DEFAULT_BACKBONE: "backbone"}
            ).items()
        },
        superres={
            k: under(v)
            for k, v in (
                parse_model_map(s.superres_models, "SUPERRES_MODELS") or {DEFAULT_SUPERRES: "superres"}
            ).items()
        },
        decoder_config=under(s.decoder_config_path or "decoder/config.yaml"),
        decoder_checkpoint=under(s.decoder_checkpoint_path or "decoder/model.pth"),
        tiny=tiny,
    )
    checks = [
        ("TOKENIZER_PATH", ckpt.tokenizer),
        ("DECODER_CONFIG_PATH", ckpt.decoder_config),
        ("DECODER_CHECKPOINT_PATH", ckpt.decoder_checkpoint),
    ]
    checks += [(f"BACKBONE_MODELS[{k}]", p) for k, p in ckpt.backbones.items()]
    checks += [(f"SUPERRES_MODELS[{k}]", p) for k, p in ckpt.superres.items()]
    for setting, path in checks:
        if not path.exists():
            raise ConfigError(f"{setting} {path} does not exist.")
    return ckpt
