"""ACE-Step's parameters as its ``RequestParser`` finds them: aliases, nested sources, loose types.

Facts (``acestep/api_server.py`` at f30aee4c, ``PARAM_ALIASES`` and ``RequestParser``):

* a parameter is looked up in three sources in order: the body, then ``param_obj``, then the first
  *truthy* one of ``metas``, ``meta``, ``metadata``, ``user_metadata``, ``userMetadata``; each nested
  source is an object or a string holding one (an empty or unreadable string is ``{}``);
* within a source, each alias in table order; the first value that is not null wins, so ``""`` and
  ``false`` count as sent (an empty top-level ``prompt`` hides one in ``metas``);
* a parameter without an entry in the table is looked up by its snake_case name only (there is no
  ``batchSize``), and ``format`` is an alias of ``use_format``, not of ``audio_format``;
* booleans: JSON ``true``/``false`` as they are; any other value is true only for ``1``, ``true``,
  ``yes``, ``y``, ``on`` (case and spaces aside), and ``""`` is the default.

Where ours differs, on purpose: a value we *use* that cannot be read as its type (``"abc"`` as a
number) is a 400 naming the key, where ACE-Step quietly takes the default; a whole float is an int
(``1.0`` takes, where ACE-Step drops it for its default of 2); a nested source that is JSON but not an
object is a 400 (ACE-Step answers a plain-text 500). ``Params`` records every key it read, so the
answer can list every key it did not (``translate.py``: ``extra.ignored``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from songserve.api.acestep.failures import field_error

ALIASES: dict[str, tuple[str, ...]] = {
    "prompt": ("prompt", "caption"),
    "lyrics": ("lyrics",),
    "thinking": ("thinking",),
    "analysis_only": ("analysis_only", "analysisOnly"),
    "full_analysis_only": ("full_analysis_only", "fullAnalysisOnly"),
    "sample_mode": ("sample_mode", "sampleMode"),
    "sample_query": ("sample_query", "sampleQuery", "description", "desc"),
    "use_format": ("use_format", "useFormat", "format"),
    "model": ("model", "model_name", "modelName", "dit_model", "ditModel"),
    "key_scale": ("key_scale", "keyscale", "keyScale", "key"),
    "time_signature": ("time_signature", "timesignature", "timeSignature"),
    "audio_duration": ("audio_duration", "duration", "audioDuration", "target_duration", "targetDuration"),
    "vocal_language": ("vocal_language", "vocalLanguage", "language"),
    "bpm": ("bpm",),
    "inference_steps": ("inference_steps", "inferenceSteps"),
    "guidance_scale": ("guidance_scale", "guidanceScale"),
    "use_random_seed": ("use_random_seed", "useRandomSeed"),
    "seed": ("seed",),
    "audio_cover_strength": ("audio_cover_strength", "audioCoverStrength"),
    "reference_audio_path": ("reference_audio_path", "ref_audio_path", "referenceAudioPath", "refAudioPath"),
    "src_audio_path": ("src_audio_path", "ctx_audio_path", "sourceAudioPath", "srcAudioPath", "ctxAudioPath"),
    "task_type": ("task_type", "taskType"),
    "infer_method": ("infer_method", "inferMethod"),
    "use_tiled_decode": ("use_tiled_decode", "useTiledDecode"),
    "constrained_decoding": ("constrained_decoding", "constrainedDecoding", "constrained"),
    "constrained_decoding_debug": ("constrained_decoding_debug", "constrainedDecodingDebug"),
    "use_cot_caption": ("use_cot_caption", "cot_caption", "cot-caption"),
    "use_cot_language": ("use_cot_language", "cot_language", "cot-language"),
    "is_format_caption": ("is_format_caption", "isFormatCaption"),
    "allow_lm_batch": ("allow_lm_batch", "allowLmBatch", "parallel_thinking"),
}
META_KEYS = ("metas", "meta", "metadata", "user_metadata", "userMetadata")
CONTAINERS = frozenset({"param_obj", *META_KEYS})
AUTH_KEY = "ai_token"
TRUE_WORDS = frozenset({"1", "true", "yes", "y", "on"})


def nested(name: str, value: Any) -> dict[str, Any]:
    """A nested source: an object, or a string holding one; empty or unreadable text is ``{}``."""
    if value is None or isinstance(value, dict):
        return value or {}
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError:
            return {}
    if not isinstance(value, dict):
        raise field_error(name, "must be a JSON object (or a string holding one)")
    return value


class Params:
    """The parameters of one request, looked up as ACE-Step looks them up."""

    def __init__(self, body: Mapping[str, Any]) -> None:
        metas_key = next((k for k in META_KEYS if body.get(k)), None)
        self.sources: list[tuple[str, Mapping[str, Any]]] = [
            ("", body),
            ("param_obj.", nested("param_obj", body.get("param_obj"))),
            (f"{metas_key}.", nested(metas_key, body[metas_key]) if metas_key else {}),
        ]
        self.read: set[str] = set()  # keys as sent (``param_obj.bpm``) whose value was used

    def find(self, name: str) -> tuple[str, Any] | None:
        """The key as sent and its value, for the first source and alias that has one."""
        for prefix, source in self.sources:
            for key in ALIASES.get(name, (name,)):
                value = source.get(key)
                if value is not None:
                    self.read.add(prefix + key)
                    return prefix + key, value
        return None

    def has(self, name: str) -> bool:
        """Sent, without marking it read (for choosing what to read)."""
        return any(source.get(k) is not None for _, source in self.sources for k in ALIASES.get(name, (name,)))

    def text(self, name: str, default: str = "") -> str:
        found = self.find(name)
        if found is None:
            return default
        value = found[1]
        if isinstance(value, bool):
            return "true" if value else "false"
        return value if isinstance(value, str) else json.dumps(value)

    def flag(self, name: str, default: bool) -> bool:
        found = self.find(name)
        if found is None:
            return default
        value = found[1]
        if isinstance(value, bool):
            return value
        word = str(value).strip().lower()
        return default if not word else word in TRUE_WORDS

    def number(self, name: str) -> tuple[str, float] | None:
        """A float (numeric strings too); ``""`` is not sent. A value that is not a finite number is a 400."""
        found = self.find(name)
        if found is None:
            return None
        key, value = found
        if isinstance(value, str) and not value.strip():
            return None
        if isinstance(value, bool):
            return key, float(value)
        try:
            number = float(value.strip() if isinstance(value, str) else value)
        except (TypeError, ValueError):
            raise field_error(key, f"must be a number, not {value!r}") from None
        if not math.isfinite(number):
            raise field_error(key, "must be a finite number")
        return key, number

    def whole(self, name: str) -> tuple[str, int] | None:
        """An int: whole floats and numeric strings too (``"2"``, ``2.0``)."""
        found = self.number(name)
        if found is None:
            return None
        key, number = found
        if not number.is_integer():
            raise field_error(key, f"must be a whole number, not {number:g}")
        return key, int(number)

    def unread(self) -> list[str]:
        """Every key sent with a value that no lookup used, as sent (``bpm``, ``metas.keyscale``)."""
        out: list[str] = []
        for prefix, source in self.sources:
            for key, value in source.items():
                if value is None or (not prefix and key in CONTAINERS | {AUTH_KEY}):
                    continue
                if prefix + key not in self.read:
                    out.append(prefix + key)
        return out
