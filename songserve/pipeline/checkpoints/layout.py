"""Which files make up the checkpoint set, from the reference's settings, validated at start-up.

With nothing configured the worker uses the tiny set in ``checkpoints/tiny`` and builds it once.
Any configured path that is missing refuses start-up with one line naming it.

Two layouts under ``CHECKPOINTS_DIR``:
- the project's own: ``backbone/``, ``superres/``, ``tokenizer/``, ``decoder/config.yaml`` + ``model.pth``;
- the published release's, so a user sets nothing but the folder they downloaded: the root holding
  ``checkpoints/`` and ``models/`` (or ``checkpoints/`` itself, ``models/`` beside it) with
  ``checkpoints/backbone/``, ``checkpoints/superresolution/``, ``checkpoints/dac_rvq_*.ckpt``,
  ``models/Tokenizer/`` and ``models/Decoder/*.yaml``. Model names follow the folder names.
Every path stays overridable by its own setting (relative paths are taken from ``CHECKPOINTS_DIR``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from songserve.errors import ConfigError
from songserve.pipeline.config import DEFAULT_TINY_DIR, CheckpointPaths

DEFAULT_BACKBONE = "default_backbone"
DEFAULT_SUPERRES = "default_superres"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointSet:
    tokenizer: Path
    backbones: dict[str, Path]
    superres: dict[str, Path]
    decoder_config: Path
    decoder_checkpoint: Path
    tiny: bool
    layout: str = "own"  # "own" or "release"
    untrained: bool = False  # seeded random weights (a set built by pipeline/tiny/): its end-of-audio is noise
    found: dict[str, str] = field(default_factory=dict)  # what was found where, for /config and the log

    def summary(self) -> str:
        return f"checkpoint set ({self.layout} layout): " + ", ".join(f"{k}={v}" for k, v in self.found.items())


@dataclass(frozen=True)
class _Release:
    checkpoints: Path
    models: Path


def release_layout(base: Path) -> _Release | None:
    """Where the release's two folders are, if ``base`` is a release root or its ``checkpoints/``."""
    if (base / "checkpoints").is_dir() and not (base / "backbone").is_dir():
        return _Release(base / "checkpoints", base / "models")
    if (base / "superresolution").is_dir() or any(base.glob("dac_rvq_*.ckpt")):
        return _Release(base, base.parent / "models")
    return None


def _one(folder: Path, pattern: str, setting: str) -> Path:
    hits = sorted(folder.glob(pattern))
    if not hits:
        raise ConfigError(f"No {folder / pattern} found for the release layout; set {setting}.")
    if len(hits) > 1:
        log.warning("several %s: using %s (set %s to choose)", folder / pattern, hits[-1].name, setting)
    return hits[-1]


def _configured(s: CheckpointPaths) -> bool:
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


def parse_model_map(text: str, setting: str) -> dict[str, str]:
    """``name=path,name=path`` or a JSON object → {name: path}."""
    text = text.strip()
    if not text:
        return {}
    if text.startswith("{"):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{setting} is not valid JSON: {exc}.") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{setting} must be a JSON object of name → path.")
        return {str(k): str(v) for k, v in raw.items()}
    out = {}
    for item in text.split(","):
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ConfigError(f"{setting} entry {item!r} is not name=path.")
        out[name.strip()] = path.strip()
    return out


def resolve(s: CheckpointPaths) -> CheckpointSet:
    """Paths of the set; builds the tiny set when nothing is configured."""
    tiny = not _configured(s)
    if tiny:  # in a child process: the checkpoint writer's helpers must not outlive it (tiny/child.py)
        from songserve.pipeline.tiny.child import build_in_child

        build_in_child(DEFAULT_TINY_DIR)
    # In full: a relative CHECKPOINTS_DIR is the caller's (settings.caller_path made it absolute against the
    # folder the launcher was run in); every path in an error below is then one a person can paste.
    base = Path(os.path.abspath(s.checkpoints_dir)) if s.checkpoints_dir else DEFAULT_TINY_DIR
    if not base.is_dir() and s.checkpoints_dir is not None:
        what = "is not a folder" if base.exists() else "does not exist"
        raise ConfigError(
            f"CHECKPOINTS_DIR {base} {what} (a relative path is taken from the folder the launcher was run in)."
        )

    def under(p: Path | str) -> Path:
        p = Path(p)
        return p if p.is_absolute() else base / p

    rel = None if tiny else release_layout(base)
    if rel is not None:
        ckpt = _resolve_release(s, rel, under)
    else:
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
        ckpt.found.update(_found(ckpt))
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
    if tiny or _untrained(base):  # any set pipeline/tiny/ built, either layout, is a tiny set
        ckpt = dataclasses.replace(ckpt, untrained=True, tiny=True)
    log.info("%s%s", ckpt.summary(), " (untrained: seeded random weights)" if ckpt.untrained else "")
    return ckpt


def _untrained(base: Path) -> bool:
    """A set that pipeline/tiny/ built says so in its MANIFEST.json (at the root, or above checkpoints/)."""
    for folder in (base, base.parent):
        try:
            manifest = json.loads((folder / "MANIFEST.json").read_text())
        except (OSError, ValueError):
            continue
        return isinstance(manifest, dict) and manifest.get("untrained") is True
    return False


def _found(ckpt: CheckpointSet) -> dict[str, str]:
    out = {f"backbone[{k}]": str(p) for k, p in ckpt.backbones.items()}
    out.update({f"superres[{k}]": str(p) for k, p in ckpt.superres.items()})
    out.update(
        tokenizer=str(ckpt.tokenizer),
        decoder_config=str(ckpt.decoder_config),
        decoder_checkpoint=str(ckpt.decoder_checkpoint),
    )
    return out


def _resolve_release(s: CheckpointPaths, rel: _Release, under: Callable[[Path | str], Path]) -> CheckpointSet:
    """The release's paths, each replaced by its setting when that is set."""

    def models(setting: str, text: str, folder: str) -> dict[str, Path]:
        given = parse_model_map(text, setting)
        if given:
            return {k: under(v) for k, v in given.items()}
        return {folder: rel.checkpoints / folder}

    ckpt = CheckpointSet(
        tokenizer=under(s.tokenizer_path) if s.tokenizer_path else rel.models / "Tokenizer",
        backbones=models("BACKBONE_MODELS", s.backbone_models, "backbone"),
        superres=models("SUPERRES_MODELS", s.superres_models, "superresolution"),
        decoder_config=under(s.decoder_config_path)
        if s.decoder_config_path
        else _one(rel.models / "Decoder", "*.yaml", "DECODER_CONFIG_PATH"),
        decoder_checkpoint=under(s.decoder_checkpoint_path)
        if s.decoder_checkpoint_path
        else _one(rel.checkpoints, "dac_rvq_*.ckpt", "DECODER_CHECKPOINT_PATH"),
        tiny=False,
        layout="release",
    )
    ckpt.found.update(_found(ckpt))
    return ckpt
