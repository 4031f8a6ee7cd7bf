"""ACE-Step's ``/v1/lora/*`` as this fleet serves adapters: scoped to the calling key, never the server.

ACE-Step holds one adapter for the whole server: one client's ``/v1/lora/load`` changes every other
client's songs. Here the same five calls set a *session* of the calling key (every task without a key
shares one when the dispatcher has no keys): which adapter its later tasks use (``load``, ``unload``),
whether they use it (``toggle``) and at what scale (``scale``). ``/release_task`` then sends the
session's adapter as our ``adapter`` and ``adapter_scale``; nothing is loaded anywhere at ``load`` time:
the workers load an adapter when a take needs it (``GET /adapters`` lists what they can load).

``lora_path`` names an adapter by its folder name in the workers' ``ADAPTERS_DIR`` or by an upload's
name (a path's last part, so ``/models/loras/studio-a`` and ``studio-a`` are the same adapter); one the
fleet cannot load, or another key's upload (``GET /adapters`` as this key sees it), is a 400 naming
``lora_path``. ``adapter_name`` is accepted as ACE-Step's multi-adapter name of the same
thing. Scales are ACE-Step's 0 to 1 (``scale`` 0 is the base model). A session lives in this
dispatcher's memory, one per key (bounded by the keys configured), and is gone at a restart, as
ACE-Step's loaded adapter is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from songserve.api.acestep.failures import AceError, field_error
from songserve.schemas.common import ADAPTER_PATTERN

NAME = re.compile(ADAPTER_PATTERN)
MAX_SCALE = 1.0  # ACE-Step's range for /v1/lora/scale


@dataclass
class LoraSession:
    """One key's adapter choice for its later tasks."""

    adapter: str | None = None
    use: bool = False
    scale: float = 1.0

    def applies(self) -> tuple[str, float] | None:
        """The adapter and scale a task of this key is made with, or None (the base model)."""
        return (self.adapter, self.scale) if self.adapter is not None and self.use else None

    def status(self) -> dict[str, Any]:
        """``GET /v1/lora/status``'s data, in ACE-Step's keys."""
        return {
            "lora_loaded": self.adapter is not None,
            "use_lora": self.use,
            "lora_scale": self.scale,
            "adapter_type": "lora" if self.adapter is not None else None,
            "scales": {self.adapter: self.scale} if self.adapter is not None else {},
            "active_adapter": self.adapter,
            "adapters": [self.adapter] if self.adapter is not None else [],
            "synthetic_default_mode": False,
        }


class LoraSessions:
    """The sessions of this dispatcher, by key name (``""``: no keys configured)."""

    def __init__(self) -> None:
        self._by_key: dict[str, LoraSession] = {}

    def of(self, key: str) -> LoraSession:
        return self._by_key.setdefault(key, LoraSession())


def adapter_name(lora_path: Any, adapter_name: Any, offered: set[str]) -> str:
    """The adapter a ``/v1/lora/load`` names: ``adapter_name`` if given, else ``lora_path``'s last part
    (without ``.safetensors``), or a 400 naming the key that is wrong."""
    key, value = (
        ("adapter_name", adapter_name)
        if isinstance(adapter_name, str) and adapter_name.strip()
        else (
            "lora_path",
            lora_path,
        )
    )
    if not isinstance(value, str) or not value.strip():
        raise field_error("lora_path", "is required: the adapter's folder name in the workers' ADAPTERS_DIR")
    name = value.strip().rstrip("/").rsplit("/", 1)[-1].removesuffix(".safetensors")
    if not NAME.match(name):
        raise field_error(key, f"{name!r} is not an adapter name (letters, digits, '.', '_', '-'; 64 at most)")
    if name not in offered:
        known = ", ".join(sorted(offered)[:20]) or "none"
        raise field_error(key, f"no worker here can load adapter {name!r} (known: {known})")
    return name


def scale_of(value: Any) -> float:
    """``/v1/lora/scale``'s ``scale``: a number from 0 to 1, or a 400."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= float(value) <= MAX_SCALE:
        raise field_error("scale", f"must be a number from 0 to {MAX_SCALE:g}")
    return float(value)


def toggle_of(session: LoraSession, value: Any) -> bool:
    """``/v1/lora/toggle``'s ``use_lora``: a boolean; turning on needs an adapter loaded (else a 400)."""
    if not isinstance(value, bool):
        raise field_error("use_lora", "must be true or false")
    if value and session.adapter is None:
        raise AceError(400, "No LoRA adapter loaded: call /v1/lora/load first")
    return value
