"""The tag catalogue for tag-mode frontends (``GET /tags``).

The built-in catalogue, ``tags.json`` beside this module, is the reference backend's own
``backend/tags.json`` (Khala-Music-AI/Khala at f3992801, 2026-05-16): four groups, ``genre_style``,
``vocal_instrument``, ``emotion_mood`` and ``production_other``, each with its bilingual ``label``
("流派/风格 (Genre/Style)", …) and its ``tags`` in the reference's order, 197 tags in all. The
reference serves that file verbatim and so do we, so a frontend written for it sees the same chips
(its default selections "Mandopop", "Female Vocals", "Acoustic Guitar", "Piano", "Atmospheric" and
"Modern Production" among them) and the tags it sends are the ones the model was trained on.

``TAGS_FILE`` replaces it with any file of that shape; a category may omit its ``label`` (filled
from the frontend's English names) or be a bare list of tags. A file that is missing or malformed
refuses start-up with one line naming the path.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from songserve.errors import ConfigError

BUILTIN = Path(__file__).with_name("tags.json")
LABELS = {
    "genre_style": "Genre/Style",
    "vocal_instrument": "Vocals/Instruments",
    "emotion_mood": "Emotion/Mood",
    "production_other": "Rhythm/Production/Other",
}
# The reference frontend's default selections: a catalogue without them leaves its chips unticked.
REFERENCE_DEFAULTS = ("Mandopop", "Female Vocals", "Acoustic Guitar", "Piano", "Atmospheric", "Modern Production")


def _category(key: str, value: Any, where: str) -> dict[str, Any]:
    if isinstance(value, list):
        value = {"tags": value}
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: category {key!r} must be an object with a 'tags' list.")
    tags = value.get("tags")
    if not isinstance(tags, list) or not tags:
        raise ConfigError(f"{where}: category {key!r} needs a non-empty 'tags' list.")
    clean: list[str] = []
    for tag in tags:
        if not isinstance(tag, str) or not tag.strip():
            raise ConfigError(f"{where}: category {key!r} has a tag that is not a non-empty string: {tag!r}.")
        clean.append(tag.strip())
    label = value.get("label", LABELS.get(key, key.replace("_", " ").title()))
    if not isinstance(label, str) or not label.strip():
        raise ConfigError(f"{where}: category {key!r} has a 'label' that is not a non-empty string.")
    return {"label": label.strip(), "tags": clean}


def load_catalogue(path: Path | str) -> dict[str, dict[str, Any]]:
    """Read and check a catalogue file; ``ConfigError`` names the path and what is wrong."""
    where = f"TAGS_FILE {path}"
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file.") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: cannot be read ({exc}).") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not valid JSON ({exc.msg} at line {exc.lineno}).") from None
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"{where}: must be a JSON object of categories.")
    return {str(key): _category(str(key), value, where) for key, value in raw.items()}


TAGS: dict[str, dict[str, Any]] = load_catalogue(BUILTIN)
