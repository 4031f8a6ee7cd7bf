"""What a request body held besides its parsed values: the fields as sent, and the unknown names, bounded.

Why: ``requests.normalize`` reports every value it reads differently from how it was sent, so it
needs the declared fields as sent (before pydantic coerced them). And a body may carry any number
of names we do not know (a typo such as ``lyric``, a field of a newer client, or 20,000 names
from someone probing): the client should hear which were ignored, so a typo does not silently
start a default job, but nothing about them may outlive the request: not in memory, not in the
job store, not raw in the log. ``read_body`` walks the top-level keys once and keeps at most
``MAX_NAMES`` unknown names, each cut to ``MAX_NAME_CHARS`` characters, and their count; their
values are never looked at, so the depth of what they hold costs nothing here. ``suggestion``
names the known field an unknown one probably misspells.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

MAX_NAMES = 32
MAX_NAME_CHARS = 64
SUGGEST_CUTOFF = 0.75  # difflib ratio: "lyric"/"lyrics" 0.91, "durration"/"duration" 0.94, "topk"/"top_k_bb" 0.67


@dataclass(frozen=True)
class UnknownFields:
    """At most ``MAX_NAMES`` of a body's unknown names (each cut), in body order, and how many there were."""

    names: tuple[str, ...] = ()
    count: int = 0

    @property
    def left_out(self) -> int:
        """Unknown names not listed in ``names``."""
        return self.count - len(self.names)


@dataclass(frozen=True)
class BodyFields:
    """The declared fields present in a body, as sent (before coercion), and its unknown names."""

    sent: dict[str, Any] = field(default_factory=dict)
    unknown: UnknownFields = UnknownFields()


def collect_unknown(body: Mapping[Any, Any], known: Collection[str]) -> UnknownFields:
    """The unknown top-level names of ``body``, bounded."""
    names: list[str] = []
    count = 0
    for key in body:
        if key in known:
            continue
        count += 1
        if len(names) < MAX_NAMES:
            names.append(str(key)[:MAX_NAME_CHARS])
    return UnknownFields(tuple(names), count)


def read_body(body: object, known: Collection[str]) -> BodyFields:
    """What ``body`` (a JSON object; anything else holds nothing) sent of ``known``, and what else."""
    if not isinstance(body, Mapping):
        return BodyFields()
    return BodyFields({k: body[k] for k in known if k in body}, collect_unknown(body, known))


def suggestion(name: str, known: Collection[str]) -> str | None:
    """The known field ``name`` most likely misspells, if one is close enough."""
    hits = difflib.get_close_matches(name.strip().lower(), list(known), n=1, cutoff=SUGGEST_CUTOFF)
    return hits[0] if hits else None


def unknown_notes(unknown: UnknownFields, known: Collection[str]) -> list[str]:
    """Sentences for the answer: each listed name, with the field it probably meant, then the rest's count."""
    out = []
    for name in unknown.names:
        near = suggestion(name, known)
        hint = f"; did you mean {near!r}?" if near else "."
        out.append(f"{name!r} is not a field and was ignored{hint}")
    if unknown.left_out:
        out.append(f"{unknown.left_out} more unknown fields were ignored (only the first {MAX_NAMES} are listed).")
    return out
