"""``/create_random_sample`` and ``/format_input``: the two helper routes, without a language model.

ACE-Step serves random examples from its ``examples/`` folders; ours come from ``examples.json``,
a small set written for this project in the same two shapes: ``simple_mode`` (``description``,
``instrumental``, ``vocal_language``) and, for any other ``sample_type``, ``text2music``
(``think``, ``caption``, ``lyrics``, ``bpm``, ``duration``, ``keyscale``, ``language``,
``timesignature``). Some captions are tags of ``/tags``, some are sentences, so both readings show.

ACE-Step's ``/format_input`` asks its LM to rewrite a caption and lyrics (503 without one). Ours
answers at once with what this server would do with them: the lyrics cleaned as ours are and the
prompt as ``translate.tag_prompt`` reads it (tags in the catalogue's spelling, or the sentence),
the other fields echoed from ``param_obj`` as ACE-Step falls back to the input.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

from songserve.api.acestep.params import nested
from songserve.api.acestep.translate import INSTRUMENTAL, tag_prompt
from songserve.api.lyrics import CleaningMode, clean_lyrics

EXAMPLES = Path(__file__).with_name("examples.json")
SIMPLE = "simple_mode"


@cache
def examples() -> dict[str, list[dict[str, Any]]]:
    data: dict[str, list[dict[str, Any]]] = json.loads(EXAMPLES.read_text(encoding="utf-8"))
    return data


def random_sample(sample_type: str) -> dict[str, Any]:
    group = examples()[SIMPLE if sample_type in ("", SIMPLE) else "text2music"]
    return dict(secrets.choice(group))


def _text(value: Any) -> str:
    return value if isinstance(value, str) else "" if value is None else json.dumps(value)


def format_input(
    fields: Mapping[str, Any], catalogue: Mapping[str, Mapping[str, Any]], cleaning: CleaningMode
) -> dict[str, Any]:
    """``prompt`` and ``lyrics`` (top level, no aliases, as ACE-Step reads them) as we would read them."""
    extra = nested("param_obj", fields.get("param_obj"))
    mode, caption = tag_prompt(_text(fields.get("prompt")), catalogue)
    lyrics = _text(fields.get("lyrics"))
    instrumental = lyrics.strip().lower() in INSTRUMENTAL
    return {
        "caption": caption,
        "lyrics": "" if instrumental else clean_lyrics(lyrics, cleaning),
        "bpm": extra.get("bpm"),
        "key_scale": extra.get("key") or extra.get("key_scale") or "",
        "time_signature": extra.get("time_signature") or fields.get("time_signature") or "",
        "duration": extra.get("duration"),
        "vocal_language": extra.get("language") or "unknown",
        "prompt_mode": mode,
        "instrumental": instrumental,
    }
