"""Lyrics cleaning (docs/api.md, "Lyrics cleaning"), applied before anything else sees them.

Why it is exactly the reference's: the model was served lyrics cleaned by the reference backend
(``backend/backend_api.py`` of the public Khala repository), so the same text must reach it here.
That cleaning is one left-to-right pass of a fixed character table, then ``str.strip()``. Nothing
else: newlines, ``\\r``, blank-line runs, tabs, control characters, emoji, ♪, ♥ and © are kept; only
the characters in the table change. The table (``_TABLE`` below) holds:

* CJK and full-width punctuation → ASCII (``。`` → ``.``, ``『』`` → ``'``, ``﹏`` → ``_``, ``、`` and
  the Arabic comma ``،`` → ``,``, ``∶`` → ``:``, ``…`` → ``...``, ``——`` as one ``-``);
* full-width ASCII U+FF01–U+FF5E → ASCII, except ``｛｜｝`` (kept as they are) and ``｀`` → ``'``;
* look-alike folding of seven small Cyrillic letters (``а е о р с у х``) and fourteen Greek capitals
  (``Α Β Ε Ζ Η Ι Κ Μ Ν Ο Ρ Τ Υ Χ``) into Latin letters, wherever they are, in any word;
* odd spaces → space, a few invisible characters (U+200B, U+FEFF, U+202A, U+202C, U+180E, U+E3AC) and
  ``★`` → nothing, ``′ ʼ ´ ^`` → ``'``, ``¨`` → ``"``, ``·`` → ``.``, ``×`` → ``x``, ``÷`` → ``/``,
  ``|`` → ``-``, and the UTF-8-read-as-Latin-1 apostrophe ``â\\x80\\x99`` → ``'``.

Where ours differs (the reference's result would change if cleaned a second time; ours is the result
of cleaning until nothing changes, so ``clean_lyrics(clean_lyrics(x)) == clean_lyrics(x)`` always):

1. ``＾`` (U+FF3E): the reference maps it to ``^`` in its one pass, and ``^`` → ``'`` on a second.
   Ours gives ``'``.
2. The mojibake apostrophe split by a character the table deletes (``â\\u200b\\x80\\x99``): the
   deletion joins it in the reference's output, which a second pass would turn into ``'``. Ours
   gives ``'``.

On every other text the result is the reference's, character for character.

``LYRICS_CLEANING=preserve-scripts`` (our extension) keeps real Cyrillic and Greek words intact: a
look-alike letter is folded only inside a word that also has Latin letters (``hеllo`` with a
Cyrillic ``е`` still becomes ``hello``; ``Привет`` and ``ΑΘΗΝΑ`` stay as written). Everything else is
the reference's cleaning.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Literal

CleaningMode = Literal["reference", "preserve-scripts"]
CLEANING_MODES: tuple[str, ...] = ("reference", "preserve-scripts")

_PUNCTUATION = {
    "。": ".",
    "、": ",",
    "،": ",",  # Arabic comma
    "「": '"',
    "」": '"',
    "『": "'",
    "』": "'",
    "【": "[",
    "】": "]",
    "〖": "[",
    "〗": "]",
    "《": "<",
    "》": ">",
    "〈": "<",
    "〉": ">",
    "“": '"',
    "”": '"',
    "‘": "'",
    "’": "'",
    "——": "-",  # a CJK dash pair is one hyphen
    "—": "-",
    "–": "-",
    "―": "-",
    "﹣": "-",
    "…": "...",
    "﹏": "_",
    "・": " ",
    "∶": ":",
}

# Full-width forms U+FF01..U+FF5E are ASCII shifted by 0xFEE0; the reference maps all of them but
# ｛ ｜ ｝ (kept) and ｀ (to an apostrophe, not a backtick).
_FULLWIDTH = {chr(c): chr(c - 0xFEE0) for c in range(0xFF01, 0xFF5F) if chr(c) not in "｛｜｝｀"}
_FULLWIDTH["｀"] = "'"

_LOOKALIKES = {
    # Cyrillic small letters
    "а": "a",
    "е": "e",
    "о": "o",
    "р": "p",
    "с": "c",
    "у": "y",
    "х": "x",
    # Greek capital letters
    "Α": "A",
    "Β": "B",
    "Ε": "E",
    "Ζ": "Z",
    "Η": "H",
    "Ι": "I",
    "Κ": "K",
    "Μ": "M",
    "Ν": "N",
    "Ο": "O",
    "Ρ": "P",
    "Τ": "T",
    "Υ": "Y",
    "Χ": "X",
}

_SPACES_AND_INVISIBLES = {
    "\u00a0": " ",
    "\u3000": " ",
    "\u2005": " ",
    "\u2006": " ",
    "\u2028": " ",
    "\u200b": "",
    "\ufeff": "",
    "\u202a": "",
    "\u202c": "",
    "\u180e": "",
    "\ue3ac": "",
}

_SIGNS = {
    "′": "'",
    "ʼ": "'",
    "´": "'",
    "^": "'",
    "¨": '"',
    "·": ".",
    "×": "x",
    "÷": "/",
    "|": "-",
    "★": "",
    "â\x80\x99": "'",  # U+2019 as UTF-8 bytes read as Latin-1
}

_TABLE: dict[str, str] = {**_PUNCTUATION, **_FULLWIDTH, **_LOOKALIKES, **_SPACES_AND_INVISIBLES, **_SIGNS}
# Longest keys first: at one position "——" wins over "—", as in the reference's alternation order.
_PATTERN = re.compile("|".join(re.escape(k) for k in sorted(_TABLE, key=len, reverse=True)))
_MAX_PASSES = 8


def _is_latin_letter(c: str) -> bool:
    return c.isalpha() and unicodedata.name(c, "").startswith("LATIN")


def _word_has_latin(text: str, at: int) -> bool:
    """Does the run of letters around ``text[at]`` contain a Latin letter?"""
    start, end = at, at + 1
    while start > 0 and text[start - 1].isalpha():
        start -= 1
    while end < len(text) and text[end].isalpha():
        end += 1
    return any(_is_latin_letter(c) for c in text[start:end])


def _one_pass(text: str, mode: CleaningMode) -> str:
    if mode == "reference":
        return _PATTERN.sub(lambda m: _TABLE[m.group(0)], text).strip()
    # preserve-scripts: everything but the folding first, then fold look-alikes word by word on the
    # result (so a deleted zero-width character cannot split a word differently on a second pass).
    text = _PATTERN.sub(lambda m: m.group(0) if m.group(0) in _LOOKALIKES else _TABLE[m.group(0)], text)
    out = [_LOOKALIKES[c] if c in _LOOKALIKES and _word_has_latin(text, i) else c for i, c in enumerate(text)]
    return "".join(out).strip()


def clean_lyrics(text: str, mode: CleaningMode = "reference") -> str:
    """Clean ``text`` as the reference does (see the module docstring), stable under a second call."""
    if mode not in CLEANING_MODES:
        raise ValueError(f"unknown lyrics cleaning mode {mode!r}; use one of {', '.join(CLEANING_MODES)}")
    for _ in range(_MAX_PASSES):
        cleaned = _one_pass(text, mode)
        if cleaned == text:
            return cleaned
        text = cleaned
    return text
