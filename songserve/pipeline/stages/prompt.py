"""The reference prompt format (docs/model.md, "Prompt"), vocal and instrumental.

    BOS style EOM language EOM BOL EOL lyrics(\\n → EOL) EOM DUR(minutes) EOT BOA

An instrumental prompt has language ``Instrumental`` and no lyrics block. A prompt longer than the
model's limit loses lyrics first, then style, never the duration token or the closing tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from songserve.errors import RequestError
from songserve.pipeline.stages import tokenizer as tk
from songserve.pipeline.stages.tokenizer import TextTokenizer


@dataclass(frozen=True)
class PromptRequest:
    style: str  # description, else tags, else genre (see ``style_of``)
    lyrics: str
    duration_min: float
    language: str = ""
    instrumental: bool = False


def style_of(description: str, tags: str, genre: str) -> str:
    return (description or "").strip() or (tags or "").strip() or (genre or "").strip()


def duration_minutes_token(duration_min: float) -> int:
    """Whole minutes for the duration token: rounded up, at least 1, at most the last token."""
    return max(1, min(tk.MAX_DURATION_TOKEN, math.ceil(duration_min - 1e-9)))


def build_prompt(tok: TextTokenizer, req: PromptRequest, max_len: int) -> list[int]:
    """Token ids of the prompt, shortened to ``max_len`` without losing its fixed tokens."""
    sid = tok.token_id
    head = [sid(tk.BOS)]
    style = tok.encode(req.style) if req.style else []
    language = "Instrumental" if req.instrumental else req.language
    middle = [sid(tk.EOM)] + (tok.encode(language) if language else []) + [sid(tk.EOM)]
    lyrics: list[int] = []
    if not req.instrumental:
        lyrics = [sid(tk.BOL), sid(tk.EOL)]
        for i, line in enumerate(req.lyrics.split("\n")):
            if i:
                lyrics.append(sid(tk.EOL))
            if line:
                lyrics.extend(tok.encode(line))
        lyrics.append(sid(tk.EOM))
    tail = [sid(tk.duration_token(duration_minutes_token(req.duration_min))), sid(tk.EOT), sid(tk.BOA)]

    fixed = len(head) + len(middle) + len(tail)
    if fixed + (3 if lyrics else 0) > max_len:
        raise RequestError(f"The prompt limit of {max_len} tokens is too small for the prompt format.")
    over = fixed + len(style) + len(lyrics) - max_len
    if over > 0 and lyrics:
        # Keep BOL EOL at the start and the closing EOM of the lyrics block.
        keep = max(2, len(lyrics) - 1 - over)
        over -= len(lyrics) - 1 - keep
        lyrics = lyrics[:keep] + lyrics[-1:]
    if over > 0:
        style = style[: max(0, len(style) - over)]
    return head + style + middle + lyrics + tail
