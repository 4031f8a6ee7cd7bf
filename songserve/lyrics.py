"""Lyrics cleaning (shared/docs/api.md, "Lyrics cleaning"), applied before anything else sees them.

Newlines are kept, the result is stripped; ``clean_lyrics`` is idempotent.
"""

from __future__ import annotations

import re
import unicodedata

_CJK_PUNCT = {
    "。": ".",
    "，": ",",
    "！": "!",
    "？": "?",
    "：": ":",
    "；": ";",
    "（": "(",
    "）": ")",
    "【": "[",
    "】": "]",
    "「": '"',
    "」": '"',
    "『": '"',
    "』": '"',
    "《": "<",
    "》": ">",
    "、": ",",
    "“": '"',
    "”": '"',
    "‘": "'",
    "’": "'",
    "——": "-",
    "–": "-",
    "—": "-",
    "―": "-",
    "﹣": "-",
    "…": "...",
    "～": "~",
    "・": " ",
    "〖": "[",
    "〗": "]",
    "〈": "<",
    "〉": ">",
}
_SIGNS = {"′": "'", "ʼ": "'", "´": "'", "¨": '"', "·": ".", "×": "x", "÷": "/", "|": "-"}

# Cyrillic and Greek letters that look like Latin ones, as they turn up in pasted lyrics.
_LOOKALIKES = {
    # Cyrillic capitals and small letters
    "А": "A",
    "В": "B",
    "Е": "E",
    "К": "K",
    "М": "M",
    "Н": "H",
    "О": "O",
    "Р": "P",
    "С": "C",
    "Т": "T",
    "У": "Y",
    "Х": "X",
    "Ѕ": "S",
    "І": "I",
    "Ј": "J",
    "Ԛ": "Q",
    "Ԝ": "W",
    "а": "a",
    "е": "e",
    "о": "o",
    "р": "p",
    "с": "c",
    "у": "y",
    "х": "x",
    "ѕ": "s",
    "і": "i",
    "ј": "j",
    "һ": "h",
    "ԁ": "d",
    "ԛ": "q",
    "ԝ": "w",
    # Greek capitals and small letters
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
    "ο": "o",
    "ν": "v",
    "ι": "i",
    "κ": "k",
    "ρ": "p",
    "τ": "t",
    "υ": "u",
    "χ": "x",
}
_ZERO_WIDTH = "\u200b\u200c\u200d\u2060\ufeff\u00ad\u180e"
_ODD_SPACES = (
    "\u00a0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u202f\u205f\u3000\u2028\u2029"
)

_TABLE = str.maketrans(
    {
        **{k: v for k, v in _CJK_PUNCT.items() if len(k) == 1},
        **_SIGNS,
        **_LOOKALIKES,
        **{c: None for c in _ZERO_WIDTH},
        **{c: " " for c in _ODD_SPACES},
    }
)
_BLANK_RUNS = re.compile(r"\n[ \t]*(?:\n[ \t]*)+\n")


def _fullwidth_to_ascii(text: str) -> str:
    return "".join(chr(ord(c) - 0xFEE0) if 0xFF01 <= ord(c) <= 0xFF5E else c for c in text)


def _keep(c: str) -> bool:
    """Drop control characters (but \\n and \\t) and stray symbols such as ★ (category So)."""
    if c in "\n\t":
        return True
    cat = unicodedata.category(c)
    return not (cat.startswith("C") or cat == "So" or (cat == "Sk" and ord(c) > 127))


def clean_lyrics(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("——", "-")
    text = _fullwidth_to_ascii(text.translate(_TABLE))
    text = "".join(c for c in text if _keep(c))
    text = _BLANK_RUNS.sub("\n\n", text)
    return text.strip()
