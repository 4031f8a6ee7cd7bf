"""Whether a current tiny set is at a folder: its ``MANIFEST.json`` names the writer's version.

Apart from ``build.py`` because asking costs no torch import: a worker asks before it starts a
build in a child (``child.py``), and the test session asks once per test process. A set is renamed
into place only once whole, with its manifest, so a current manifest means a whole set.
"""

from __future__ import annotations

import json
from pathlib import Path

# 6: the tiny adapter set in adapters/; 5: the decoder file holds the codec's encoder (uploads); 4:
# model_config.json without num_tokens_to_generate
TINY_VERSION = 6
RELEASE_VERSION = 3  # 3: the golden YAML's layout and q_dropout: False


def is_built(out: Path, key: str = "tiny_version", version: int = TINY_VERSION) -> bool:
    try:
        return bool(json.loads((out / "MANIFEST.json").read_text()).get(key) == version)
    except (OSError, ValueError, AttributeError):  # AttributeError: a manifest that is no JSON object
        return False


def is_current(out: Path, layout: str = "default") -> bool:
    """Whether the set of ``layout`` (``default`` or ``release``) at ``out`` is this build's."""
    return is_built(out, "release_version", RELEASE_VERSION) if layout == "release" else is_built(out)
