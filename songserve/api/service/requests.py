"""Read a ``POST /generate`` body as the reference backend reads it, and say what was changed.

Why: scripts written for the reference backend (``backend/backend_api.py`` of the public Khala
repository) must get a song here wherever they got one there (docs/api.md, ``POST /generate``).
The reference parses the body leniently (pydantic's lax mode: ``"3"`` and ``3.0`` are 3), then
clamps ``duration`` into 1–10 minutes, ``top_k_bb`` into 1–200 and ``temperature`` into 0.6–1.4,
treats any ``mode`` but ``instrumental`` as vocal and any ``prompt_mode`` but ``tags`` as natural,
and generates a vocal song whose lyrics are empty. ``normalize`` does the same, within our
configured duration range (fractions of a minute are our extension: zero or negative becomes the
reference's 1 minute, a positive value below our minimum becomes that minimum), and reports every
value it reads differently from how it was sent in ``adjusted`` (``{"duration": {"from": 15, "to":
10.0}}``), coercions included, so a client can see what it will get; a duration it changed is said
in ``notes`` too, in a sentence.

One refusal the reference does not make: a ``duration`` of ``SECONDS_LIKE`` (30) or more, over the
maximum, is a length in seconds by habit (``180`` for a 3-minute song), which the reference would
read as its longest song; here it is a 422 naming ``duration`` and its unit. No client of the
reference sends one: its frontend offers 2 to 10 minutes.

One deliberate difference: for a ``mode`` that is neither ``vocal`` nor ``instrumental`` the
reference keeps the vocal prompt but drops the lyrics (it cleans lyrics only when ``mode ==
"vocal"``); here such a request is vocal with its lyrics, as api.md specifies.

Strict mode (``STRICT_REQUESTS=1``) refuses, with a 422 naming the field, every value that the
lenient reading would change beyond a type coercion: out-of-range numbers, unknown ``mode`` and
``prompt_mode`` words, empty lyrics for a vocal song, and tags or prompts over 1,000 characters.
Our extensions (``num_tracks``, ``seed``, ``top_k_sr``, ``backbone``, ``superres``, ``priority``)
are validated the same way in both modes.

Unknown field names are answered too (``ignored``: at most 32, each cut to 64 characters, from
``songserve/schemas/body_fields.py``), with the field each probably misspells in ``notes``; so are a body
that sets no known field and a vocal song left without lyrics, which the reference starts without
a word. The request that comes out holds none of it: what is stored with the job is the values.

The function is pure (no settings, no I/O); the caller logs the adjustments with the job id.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from songserve.api.lyrics import CLEANING_MODES, CleaningMode, clean_lyrics
from songserve.errors import FieldError
from songserve.schemas import GenerateRequest
from songserve.schemas.body_fields import unknown_notes

# The reference's ranges and defaults (its ``clamp_generate_request``).
TOP_K_BB_RANGE = (1, 200)
TEMPERATURE_RANGE = (0.6, 1.4)
NON_POSITIVE_DURATION = 1.0  # minutes: the reference's floor for 0 and below
SECONDS_LIKE = 30.0  # minutes: over the maximum and at least this, a duration was meant as seconds
STRICT_TEXT_CHARS = 1000  # strict mode only: the former limit on tags and prompt
MODES = ("vocal", "instrumental")  # the first is what an unknown word reads as
PROMPT_MODES = ("tags", "natural")


@dataclass(frozen=True)
class RequestLimits:
    """The dispatcher's configured limits and the model names its workers offer."""

    min_duration: float = 0.05
    max_duration: float = 10.0
    max_tracks: int = 4
    max_lyrics_chars: int = 10_000
    backbones: tuple[str, ...] = ()
    superres: tuple[str, ...] = ()


@dataclass(frozen=True)
class NormalizedRequest:
    """The request with the values that will be used, its cleaned lyrics, what changed, and what was ignored."""

    request: GenerateRequest
    cleaned_lyrics: str
    adjusted: dict[str, dict[str, Any]] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)  # unknown names, bounded (body_fields.py)
    unknown_count: int = 0  # all of them, listed or not
    notes: list[str] = field(default_factory=list)  # sentences for the answer


def _differs(sent: Any, used: Any) -> bool:
    """A coercion or a change: ``"3"`` → 3, ``true`` → 1 and 15 → 10 differ; 3 → 3.0 and ``true`` → ``true`` do not."""
    if isinstance(sent, bool) != isinstance(used, bool) or isinstance(sent, str) != isinstance(used, str):
        return True
    return bool(sent != used)


def _clamp(name: str, value: float, low: float, high: float, strict: bool) -> float:
    if low <= value <= high:
        return value
    if strict:
        raise FieldError(name, f"must be between {low:g} and {high:g}")
    return min(max(value, low), high)


def _duration(value: float, limits: RequestLimits, strict: bool) -> tuple[float, str | None]:
    """The minutes the song will last, and the sentence that says why they differ from ``value``."""
    low, high = limits.min_duration, limits.max_duration
    if low <= value <= high:
        return value, None
    if value > high and value >= SECONDS_LIKE:
        minutes = round(value / 60, 2)
        hint = f"for {value:g} seconds send {minutes:g}" if low <= minutes <= high else f"at most {high:g}"
        raise FieldError(
            "duration",
            f"is in minutes, and {value:g} minutes is far over the {high:g}-minute "
            f"maximum (seconds by mistake?); {hint}",
        )
    if strict:
        raise FieldError("duration", f"must be between {low:g} and {high:g} minutes")
    if value <= 0:
        used = min(max(NON_POSITIVE_DURATION, low), high)
        unit = "minute" if used == 1 else "minutes"
        return used, f"A duration of {value:g} is not a length: the song is {used:g} {unit}, as the reference reads it."
    used = min(max(value, low), high)
    edge = "maximum" if value > high else "minimum"
    return used, f"The duration is in minutes; {value:g} is past the {edge}, so the song is {used:g} minutes."


def _word(name: str, value: str, allowed: tuple[str, str], strict: bool) -> str:
    """The reference's reading: the second word only when sent exactly, else the first."""
    if value in allowed:
        return value
    if strict:
        raise FieldError(name, f"must be one of {', '.join(allowed)}")
    first, second = allowed
    return second if value == second else first


def normalize(
    req: GenerateRequest,
    limits: RequestLimits,
    *,
    strict: bool = False,
    cleaning: CleaningMode = "reference",
) -> NormalizedRequest:
    """Apply the reference's reading (or, with ``strict``, refuse what it would change).

    Raises ``FieldError`` (HTTP 422 naming the field) for values no reading can serve.
    """
    if cleaning not in CLEANING_MODES:
        raise ValueError(f"unknown lyrics cleaning mode {cleaning!r}")
    mode = _word("mode", req.mode, MODES, strict)
    # Any prompt_mode but "tags" is natural (the reference tests for "tags" only).
    prompt_mode = "tags" if req.prompt_mode == "tags" else "natural"
    if strict and req.prompt_mode not in PROMPT_MODES:
        raise FieldError("prompt_mode", f"must be one of {', '.join(PROMPT_MODES)}")
    if strict:
        for name in ("tags", "prompt"):
            if len(getattr(req, name)) > STRICT_TEXT_CHARS:
                raise FieldError(name, f"must be at most {STRICT_TEXT_CHARS} characters")
    duration, duration_note = _duration(req.duration, limits, strict)
    used: dict[str, Any] = {
        "mode": mode,
        "prompt_mode": prompt_mode,
        "duration": duration,
        "top_k_bb": int(_clamp("top_k_bb", req.top_k_bb, *TOP_K_BB_RANGE, strict)),
        "temperature": _clamp("temperature", req.temperature, *TEMPERATURE_RANGE, strict),
    }

    if req.num_tracks > limits.max_tracks:
        raise FieldError("num_tracks", f"must be at most {limits.max_tracks}")
    for name, value, offered in (
        ("backbone", req.backbone, limits.backbones),
        ("superres", req.superres, limits.superres),
    ):
        if value and offered and value not in offered:
            raise FieldError(name, f"must be one of {', '.join(offered)}")

    lyrics = clean_lyrics(req.lyrics, cleaning) if mode == "vocal" else ""
    if len(lyrics) > limits.max_lyrics_chars:
        raise FieldError("lyrics", f"must be at most {limits.max_lyrics_chars} characters after cleaning")
    if strict and mode == "vocal" and not lyrics:
        raise FieldError("lyrics", "is empty after cleaning; a vocal song needs lyrics")

    # A fresh model: the body's values as sent and its unknown names stay with ``req``, not with the job.
    final = GenerateRequest.model_construct(req.model_fields_set, **{**dict(req), **used})
    body = req.body
    adjusted: dict[str, dict[str, Any]] = {}
    for name, sent in body.sent.items():
        now = getattr(final, name)
        if isinstance(now, BaseModel):  # a nested model (continue_from, the ACE-Step extras): as sent, no defaults
            now = now.model_dump(exclude_unset=True)
        if _differs(sent, now):
            adjusted[name] = {"from": sent, "to": now}
    notes = unknown_notes(body.unknown, GenerateRequest.model_fields)
    if duration_note:
        notes.append(duration_note)
    if not body.sent:
        notes.append("The body sets none of the known fields, so every value is its default (docs/api.md).")
    if mode == "vocal" and not lyrics:
        notes.append(
            "No lyrics (or none left after cleaning): the song is generated as vocal without words, as the "
            "reference does; send mode 'instrumental' for an instrumental."
        )
    return NormalizedRequest(final, lyrics, adjusted, list(body.unknown.names), body.unknown.count, notes)
