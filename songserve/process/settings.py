"""What both programs' settings share: how flags and the environment feed a settings object, paths,
secrets in the log.

Each program has its own settings class in its own package (``songserve/api/settings.py``: the
dispatcher's; ``songserve/worker/settings.py``: the worker's). Every field can be set as an
environment variable (upper case, e.g. ``RUNTIME_MODE``) or a flag (``--runtime-mode``); flags win.
Bad values refuse to start with a one-line reason, and the non-default values are logged at start-up
with secrets redacted. This module imports no feature module.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings

from songserve.errors import ConfigError
from songserve.http.errors import clean_msg

ROOT = Path(__file__).resolve().parents[2]  # the checkout (run_backend.sh): default state and audio folders

log = logging.getLogger(__name__)
S = TypeVar("S", bound=BaseSettings)
SECRET_WORDS = ("token", "key", "secret")
LAUNCH_NONCE = "set by run_backend.sh, echoed by /health: how it tells its own child from another process on the port"
CALLER_DIR_ENV = "SONGSERVE_CALLER_DIR"  # the folder run_backend.sh was run in (it cds to the repository)


def caller_path(value: Any) -> Any:
    """A relative path setting is the caller's: taken from the folder the launcher was run in
    (``SONGSERVE_CALLER_DIR``), else this process's working folder, never the repository's; and made
    absolute here, so every message about it prints the whole path. Empty stays empty (unset)."""
    if isinstance(value, str | Path) and str(value).strip():
        path = Path(value).expanduser()
        return path if path.is_absolute() else Path(os.environ.get(CALLER_DIR_ENV) or os.getcwd()) / path
    return value


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def load_settings(cls: type[S], argv: Sequence[str] | None = None, **overrides: Any) -> S:
    """Environment, then flags (generated from the fields), then keyword overrides."""
    parser = argparse.ArgumentParser(description=(cls.__doc__ or "").strip())
    for name, field in cls.model_fields.items():
        parser.add_argument(_flag(name), dest=name, default=None, help=field.description)
    ns = parser.parse_args(list(argv) if argv is not None else [])
    values = {k: v for k, v in vars(ns).items() if v is not None}
    values.update(overrides)
    try:
        return cls(**values)
    except ValidationError as exc:
        err = exc.errors()[0]
        name = str(err["loc"][0]) if err["loc"] else ""
        got = "***" if any(w in name for w in SECRET_WORDS) else repr(err.get("input"))  # a secret stays unsaid
        raise ConfigError(f"Setting {name}: {clean_msg(err['msg'])} (got {got}).") from None


def log_non_default(settings: BaseSettings) -> None:
    for name, field in type(settings).model_fields.items():
        value = getattr(settings, name)
        if value != field.default:
            shown = "***" if any(w in name for w in SECRET_WORDS) and value else value
            log.info("setting %s=%s", name, shown)
