"""Logging configured once, at each entry point, and the one helper for text that is not ours.

Why: a log line is evidence only if nobody else can write one. Request fields, unknown field
names, lyrics and tags excerpts, error texts from workers and exception messages all end up in
log messages; a newline in any of them would start a line that looks like ours, and a 3 MB value
would make one line of 3 MB. ``safe`` escapes control characters and Unicode line breaks
(``\\n`` → ``\\\\n``) and caps the length, saying how much was cut; call sites use it for each free
value they log. ``LineFormatter`` applies the same escaping to every record's message and caps it
at ``MAX_MESSAGE_CHARS``, and indents traceback lines, so no path into the log can forge a line,
including third-party loggers and messages nobody wrapped.

Third-party start-up noise (megatron-core's Transformer-Engine/Apex warnings and its INFO lines,
httpx's request lines) is silenced unless the level is DEBUG.
"""

from __future__ import annotations

import logging
import os
import re
import warnings

MAX_MESSAGE_CHARS = 4000  # one record's message; a checkpoint summary of many models fits
DEFAULT_VALUE_CHARS = 200  # one free value inside a message
# C0 and C1 controls, DEL, and the Unicode line and paragraph separators a viewer may break on.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

_QUIET_WARNINGS = (
    ".*Transformer Engine and Apex are not installed.*",
    ".*Apex is not installed.*",
    ".*deprecating ShardedTensor.*",
)
_QUIET_LOGGERS = ("megatron", "httpx", "torch.distributed")


def _escape_char(m: re.Match[str]) -> str:
    c = m.group(0)
    return _NAMED.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")


def escape(text: str) -> str:
    """``text`` on one line: control characters and line separators written as escapes."""
    return _UNSAFE.sub(_escape_char, text)


def safe(value: object, limit: int = DEFAULT_VALUE_CHARS) -> str:
    """A free value for a log message: on one line, at most about ``limit`` characters.

    The cut is made before escaping (so an escape is never split) and says how many characters
    were left out: ``'abc…(+1200 chars)'``.
    """
    text = value if isinstance(value, str) else str(value)
    cut = len(text) - limit
    if cut > 0:
        return f"{escape(text[:limit])}…(+{cut} chars)"
    return escape(text)


class LineFormatter(logging.Formatter):
    """Each record's message escaped onto one line and capped; traceback lines indented under it."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = safe(record.message, MAX_MESSAGE_CHARS)
        return super().formatMessage(record)

    def formatException(self, ei: object) -> str:
        text = super().formatException(ei)  # type: ignore[arg-type]
        return "\n".join("    " + escape(line) for line in text.splitlines())

    def formatStack(self, stack_info: str) -> str:
        return "\n".join("    " + escape(line) for line in stack_info.splitlines())


def level_from_env(default: str = "INFO") -> str:
    """``LOG_LEVEL`` as given (``setup_logging`` says so when it is not a level)."""
    return os.environ.get("LOG_LEVEL", "").strip() or default


def quiet_third_party(level: str) -> None:
    """Silence the libraries' start-up warnings and INFO lines, unless ``level`` is DEBUG."""
    if level.upper() == "DEBUG":
        logging.captureWarnings(True)  # then they are log lines, with our format
        return
    for message in _QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def setup_logging(name: str, level: str = "INFO") -> None:
    """One handler on the root logger with ``LineFormatter``; calling it again replaces it."""
    wanted = level.strip().upper()
    level = wanted if wanted in LEVELS else "INFO"
    handler = logging.StreamHandler()
    handler.setFormatter(LineFormatter(f"%(asctime)s %(levelname)s {name} %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    quiet_third_party(level)
    if wanted != level:
        logging.getLogger(__name__).warning(
            "LOG_LEVEL %s is not one of %s: using INFO", safe(wanted), ", ".join(LEVELS)
        )
