"""ACE-Step's ``/release_task`` parameters → our ``GenerateRequest``: the one translation of the dialect.

Beside ``songserve/api/service/requests.py`` (which then reads the request as the reference backend reads
it): this module only renames and converts. What maps (docs/api.md, "ACE-Step's dialect"):

* ``prompt``/``caption`` → the style prompt: tags when every comma-separated item is a tag of
  ``/tags`` (in the catalogue's spelling), else a natural-language prompt;
* ``lyrics`` → lyrics (cleaned later, as ours are); ACE-Step's instrumental rule (empty, ``[inst]``,
  ``[instrumental]``, any case) → ``mode: instrumental``;
* ``audio_duration`` seconds → ``duration`` minutes; absent or ≤ 0 (ACE-Step: "the model chooses")
  → our default;
* ``batch_size`` (ACE-Step's default 2) → ``num_tracks``, clamped into 1–``MAX_TRACKS`` as ACE-Step
  clamps to its GPU's limit;
* ``use_random_seed: false`` with ``seed`` → our ``seed``: take *i* uses ``seed + i`` (ACE-Step gives
  take 0 the seed and draws the others); a list ``"7,8"`` is read when it is that sequence; a negative
  seed draws; with ``use_random_seed`` true (its default) ``seed`` is ignored, as ACE-Step ignores it;
* ``model`` → a backbone of ``/config`` (an ``acestep/`` prefix dropped); another name is read as
  the default backbone, as ACE-Step falls back to its primary model;
* ``audio_format`` ``mp3``/``wav``/``flac`` → the file served; another word is FLAC, as ACE-Step saves it.

Everything read differently from how it was sent is reported in ``adjusted`` (as our own route
does), and under ``STRICT_REQUESTS=1`` refused instead. Every other key sent is listed in
``ignored``: diffusion steps, guidance, ``thinking``, ``lm_*``, ``bpm``, ``key_scale``, … mean nothing
to this model, and none is dropped without saying so. ``task_type`` ``text2music`` generates;
``repaint`` is checked by ``repaint.py``; any other task type, any reference audio, and a
``src_audio_path`` that is not a file of ours are 400s naming the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from songserve.api.acestep import repaint
from songserve.api.acestep.bodies import Upload
from songserve.api.acestep.failures import field_error
from songserve.api.acestep.files import FORMATS, AudioRef, parse_source
from songserve.api.acestep.params import Params
from songserve.http.errors import clean_msg
from songserve.schemas import GenerateRequest

TASK_TYPES = ("text2music", "repaint")
INSTRUMENTAL = ("", "[inst]", "[instrumental]")
DEFAULT_TAKES = 2  # ACE-Step's batch size when none is sent
REFERENCE_UPLOADS = ("ref_audio", "reference_audio")
SOURCE_UPLOADS = ("ctx_audio", "src_audio")
EXTRA = "acestep"  # GenerateRequest.acestep: what the dialect's answers need later of the job
MODEL_PREFIX = "acestep/"  # OpenRouter-style ids
# Our request fields under the name ACE-Step's clients know them by (when they sent no alias).
ACE_NAMES = {
    "duration": "audio_duration",
    "num_tracks": "batch_size",
    "backbone": "model",
    "seed": "seed",
    "lyrics": "lyrics",
    "mode": "lyrics",
    "prompt": "prompt",
    "tags": "prompt",
}


@dataclass(frozen=True)
class Context:
    """What the translation needs of the dispatcher: its tag catalogue, limits and models."""

    catalogue: Mapping[str, Mapping[str, Any]]
    max_tracks: int
    backbones: tuple[str, ...]
    strict: bool


@dataclass
class Task:
    """A text2music task as our request, with what the answer says about it."""

    request: GenerateRequest
    audio_format: str
    prompt_mode: str
    keys: dict[str, str]  # our field → the key the client sent it as
    adjusted: dict[str, dict[str, Any]] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)
    source: AudioRef | None = None  # a src_audio_path sent with text2music: checked, then ignored
    upload_id: str | None = None  # a repaint's uploaded source, stored as our upload (removed if refused)

    def extra(self) -> dict[str, Any]:
        return {"ignored": self.ignored, "adjusted": self.adjusted, "prompt_mode": self.prompt_mode}


@dataclass
class Repaint:
    """``task_type: repaint``: write ``source`` again from ``start`` seconds to ``end`` (None: to its end),
    as ``task`` says."""

    task: Task
    start: float
    source: AudioRef | Upload
    end: float | None = None


def tag_prompt(text: str, catalogue: Mapping[str, Mapping[str, Any]]) -> tuple[str, str]:
    """("tags", the tags in the catalogue's spelling) when every item is a known tag, else ("natural", text)."""
    known = {str(t).lower(): str(t) for cat in catalogue.values() for t in cat.get("tags", ())}
    items = [i.strip() for i in text.split(",") if i.strip()]
    if items and all(i.lower() in known for i in items):
        return "tags", ", ".join(known[i.lower()] for i in items)
    return "natural", text.strip()


def _lenient(ctx: Context, task: Task, key: str, sent: Any, used: Any, why: str) -> None:
    """A value read differently: said in ``adjusted``, or refused under STRICT_REQUESTS."""
    if ctx.strict:
        raise field_error(key, why)
    task.adjusted[key] = {"from": sent, "to": used}


def _seed(p: Params, takes: int) -> tuple[str, int | None] | None:
    """(key, our base seed or None to draw), or None when no fixed seed is asked for."""
    if p.flag("use_random_seed", True) or not p.has("seed"):
        return None
    found = p.find("seed")
    assert found is not None
    key, value = found
    items = value if isinstance(value, list) else str(value).split(",")
    try:
        seeds = [int(float(str(s).strip())) for s in items if str(s).strip()]
    except (ValueError, OverflowError):  # "abc", "nan"; "inf"
        raise field_error(key, f"must be a whole number or a comma-separated list of them, not {value!r}") from None
    if not seeds or seeds[0] < 0:
        return key, None  # ACE-Step's -1: draw
    wanted = seeds[:takes]
    if wanted != [seeds[0] + i for i in range(len(wanted))]:
        raise field_error(key, f"takes use seed, seed+1, …; the list {value!r} is not such a sequence")
    return key, seeds[0]


def _common(p: Params, ctx: Context) -> Task:
    keys: dict[str, str] = {}
    body: dict[str, Any] = {}
    caption = p.find("prompt")
    text = p.text("prompt")
    mode, style = tag_prompt(text, ctx.catalogue)
    body["prompt_mode"] = mode
    body["tags" if mode == "tags" else "prompt"] = style
    if caption:
        keys["tags"] = keys["prompt"] = caption[0]
    lyrics_key = p.find("lyrics")
    lyrics = p.text("lyrics")
    body["mode"] = "instrumental" if lyrics.strip().lower() in INSTRUMENTAL else "vocal"
    body["lyrics"] = lyrics
    if lyrics_key:
        keys["lyrics"] = keys["mode"] = lyrics_key[0]
    fmt_found = p.find("audio_format")
    fmt = (p.text("audio_format", "mp3").strip().lower() or "mp3") if fmt_found else "mp3"
    task = Task(GenerateRequest(), fmt, mode, keys)
    if fmt not in FORMATS:
        _lenient(ctx, task, "audio_format", fmt_found[1] if fmt_found else fmt, "flac", "must be mp3, wav or flac")
        task.audio_format = "flac"

    duration = p.number("audio_duration")
    if duration is not None:
        keys["duration"] = duration[0]
        if duration[1] > 0:
            body["duration"] = duration[1] / 60
        else:  # ACE-Step: the model (or its LM) picks a length; ours is the default length
            default_sec = GenerateRequest.model_fields["duration"].default * 60
            _lenient(ctx, task, duration[0], duration[1], default_sec, "must be more than 0 seconds")

    batch = p.whole("batch_size")
    takes = batch[1] if batch else DEFAULT_TAKES
    clamped = min(max(takes, 1), ctx.max_tracks)
    if clamped != takes:
        _lenient(ctx, task, "batch_size", takes, clamped, f"must be between 1 and {ctx.max_tracks}")
    body["num_tracks"] = clamped

    seed = _seed(p, clamped)
    if seed is not None:
        keys["seed"] = seed[0]
        body["seed"] = seed[1]

    model = p.find("model")
    name = p.text("model").strip()
    if model and name:
        keys["backbone"] = model[0]
        chosen = next((n for n in (name, name.removeprefix(MODEL_PREFIX)) if n in ctx.backbones), None)
        if chosen or not ctx.backbones:
            body["backbone"] = chosen or name
        else:
            why = f"must be one of {', '.join(ctx.backbones)}"
            _lenient(ctx, task, model[0], name, ctx.backbones[0], why)
    body[EXTRA] = {"audio_format": task.audio_format, "caption": text}
    try:
        task.request = GenerateRequest.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        ours = str(err["loc"][0]) if err.get("loc") else "body"
        raise field_error(keys.get(ours, ACE_NAMES.get(ours, ours)), clean_msg(err["msg"]).rstrip(".")) from None
    return task


def read_task(p: Params, uploads: Mapping[str, Upload], ctx: Context) -> Task | Repaint:
    """The task a ``/release_task`` body asks for, or a 400 naming the key that cannot be served."""
    found = p.find("task_type")
    task_type = p.text("task_type").strip() or "text2music"
    if task_type not in TASK_TYPES:
        raise field_error(
            found[0] if found else "task_type",
            f"{task_type!r} is not served here: this model generates (text2music) and continues a take to its "
            "end (repaint with repainting_end -1); cover, lego, extract and complete need models it does not have",
        )
    ref = p.find("reference_audio_path")
    if ref and str(ref[1]).strip():
        raise field_error(ref[0], "this model takes no reference audio")
    for name in REFERENCE_UPLOADS:
        if name in uploads:
            raise field_error(name, "this model takes no reference audio")
    src = p.find("src_audio_path")
    source: AudioRef | None = None
    if src and str(src[1]).strip():
        source = parse_source(str(src[1]))
        if source is None:
            raise field_error(src[0], "is not an audio file this server returned (send back a result's file)")
    upload = next((uploads[n] for n in SOURCE_UPLOADS if n in uploads), None)

    task = _common(p, ctx)
    if src:
        task.keys["src_audio_path"] = src[0]
    if task_type == "repaint":
        start, end, whence = repaint.read(p, source, upload)
        if (start_key := p.find("repainting_start")) is not None:
            task.keys["at_sec"] = start_key[0]  # continue_from.at_sec, as the client named it
        if (end_key := p.find("repainting_end")) is not None:
            task.keys["end_sec"] = end_key[0]
        out: Task | Repaint = Repaint(task, start, whence, end)
    else:
        task.source = source
        out = task
    task.ignored = p.unread() + [n for n in uploads if not (task_type == "repaint" and uploads[n] is upload)]
    if task_type != "repaint" and src and source:
        task.ignored.append(src[0])  # read to be checked; text2music has no use for it
    return out
