"""Text tokenizers: the tiny set's sentencepiece model, or a Hugging Face ``tokenizer.json`` folder.

Which one is used depends on what the configured path holds (``load_tokenizer``). Both expose the
same small seam, ``TextTokenizer``, and both know the prompt's special tokens as single ids, always
looked up by name: in the release's Llama-3.1 tokenizer the duration tokens
``<|reserved_special_token_0..15|>`` are ids 128002, 128003, 128005, 128011…128023 (not consecutive).
A released folder (``tokenizer.json`` + ``tokenizer_config.json``) is read with the ``tokenizers``
library alone; the config's ``added_tokens_decoder`` and BOS/EOS names are checked against the
tokenizer. ``check_text_vocab`` is the start-up check that a model's text vocabulary (where its
audio ids begin) is this tokenizer's size.
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

from songserve.errors import ConfigError

log = logging.getLogger(__name__)

BOS = "<|begin_of_text|>"
EOD = "<|end_of_text|>"
EOM = "<|eom_id|>"
BOL = "<|start_header_id|>"
EOL = "<|end_header_id|>"
EOT = "<|eot_id|>"
BOA = "<|python_tag|>"
MAX_DURATION_TOKEN = 15  # <|reserved_special_token_0..15|>: whole minutes


def duration_token(minutes: int) -> str:
    return f"<|reserved_special_token_{minutes}|>"


SPECIAL_TOKENS: tuple[str, ...] = (BOS, EOD, EOM, BOL, EOL, EOT, BOA) + tuple(
    duration_token(m) for m in range(MAX_DURATION_TOKEN + 1)
)


class TextTokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def token_id(self, piece: str) -> int: ...


class SentencePieceTokenizer:
    def __init__(self, model_proto: bytes, source: str) -> None:
        import sentencepiece as spm

        self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        self.vocab_size = int(self._sp.get_piece_size())
        self.source = source

    def encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text))

    def decode(self, ids: Iterable[int]) -> str:
        return str(self._sp.decode([int(i) for i in ids]))

    def token_id(self, piece: str) -> int:
        idx = int(self._sp.piece_to_id(piece))
        if idx == self._sp.unk_id() and piece != self._sp.id_to_piece(idx):
            raise ConfigError(f"Tokenizer {self.source} has no special token {piece}.")
        return idx


class HFTokenizer:
    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path))
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.source = str(path)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Iterable[int]) -> str:
        return str(self._tok.decode([int(i) for i in ids], skip_special_tokens=False))

    def token_id(self, piece: str) -> int:
        idx = self._tok.token_to_id(piece)
        if idx is None:
            raise ConfigError(f"Tokenizer {self.source} has no special token {piece}.")
        return int(idx)


def load_tokenizer(path: str | Path) -> TextTokenizer:
    """Load by what the path holds: ``tokenizer.json`` (HF) or a sentencepiece ``.model``."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"Tokenizer path {p} does not exist.")
    candidates = [p] if p.is_file() else [p / "tokenizer.json", p / "tokenizer.model"]
    for c in candidates:
        if not c.is_file():
            continue
        try:
            if c.suffix == ".json":
                tok: TextTokenizer = HFTokenizer(c)
            else:
                tok = SentencePieceTokenizer(c.read_bytes(), str(c))
        except ConfigError:
            raise
        except Exception as exc:  # the libraries raise assorted types for corrupt files
            raise ConfigError(f"Tokenizer file {c} could not be read: {exc}") from exc
        if c.suffix == ".json" and (c.parent / "tokenizer_config.json").is_file():
            check_tokenizer_config(tok, c.parent / "tokenizer_config.json")
        for piece in SPECIAL_TOKENS:
            tok.token_id(piece)
        return tok
    raise ConfigError(f"Tokenizer path {p} holds neither tokenizer.json nor tokenizer.model.")


def check_tokenizer_config(tok: TextTokenizer, path: Path) -> None:
    """The config's ``added_tokens_decoder`` ids and BOS/EOS names must agree with the tokenizer."""
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"Tokenizer config {path} could not be read: {exc}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"Tokenizer config {path} is not a JSON object.")
    decoder = cfg.get("added_tokens_decoder", {})
    if not isinstance(decoder, dict):
        raise ConfigError(f"Tokenizer config {path}: 'added_tokens_decoder' is not an object.")
    for key, entry in decoder.items():
        content = entry.get("content") if isinstance(entry, dict) else None
        if not isinstance(content, str) or not str(key).isdigit():
            raise ConfigError(f"Tokenizer config {path}: 'added_tokens_decoder' entry {key!r} is malformed.")
        try:
            actual = tok.token_id(content)
        except ConfigError:
            raise ConfigError(
                f"Tokenizer config {path} lists {content} at id {key}, but tokenizer.json does not have it."
            ) from None
        if actual != int(key):
            raise ConfigError(
                f"Tokenizer config {path} lists {content} at id {key}, but tokenizer.json has it at {actual}."
            )
    for role in ("bos_token", "eos_token"):
        name = cfg.get(role)
        name = name.get("content") if isinstance(name, dict) else name
        if isinstance(name, str):
            try:
                tok.token_id(name)
            except ConfigError:
                raise ConfigError(f"Tokenizer config {path}: {role} {name} is not in tokenizer.json.") from None


def special_token_ids(tok: TextTokenizer) -> dict[str, int]:
    """Every prompt special token's id, by name (for the start-up log and metadata)."""
    return {piece: tok.token_id(piece) for piece in SPECIAL_TOKENS}


def check_text_vocab(tok: TextTokenizer, model_text_vocab: int, model: str) -> int:
    """Refuse a model whose text vocabulary differs from the tokenizer's size; return that size.

    The size is where the model's audio ids begin (q0 at ``T``), so a mismatch would shift every
    audio token, silently: this is a start-up check, one line naming both numbers.
    """
    size = int(tok.vocab_size)
    if size != model_text_vocab:
        raise ConfigError(
            f"Tokenizer {getattr(tok, 'source', '?')} has {size} ids, but model {model} has a text vocabulary of "
            f"{model_text_vocab} (its audio ids start there); use the tokenizer the model was trained with."
        )
    return size


# A small built-in corpus of lyric-like lines, English and Chinese, for the tiny set's tokenizer.
_CORPUS_EN = """\
[verse]
I walked along the river where the city lights are low
every window holds a story that the morning will not know
we were dancing in the kitchen with the radio on
and the night was getting younger when the summer was gone
[chorus]
hold me closer, hold me now, don't let the moment fade
all the words we never said are songs we could have made
oh oh oh, sing it loud, the stars are coming through
every road I ever took was leading back to you
[bridge]
rain on the window, fire in my heart
we were written in the margins, we were broken from the start
pop, rock, jazz, piano, guitar, drums, bass, synth, female vocal, male vocal
happy, sad, energetic, calm, romantic, dark, dreamy, upbeat, mellow
electronic, hip hop, folk, country, ballad, dance, lo-fi, acoustic, orchestral
"""
_CORPUS_ZH = """\
[verse]
月光洒在窗前 我想起你的笑脸
风吹过了街角 时间慢慢走远
我们曾经一起 唱着那首老歌
[chorus]
爱你在每一天 梦里也不改变
星星照亮夜空 带我回到从前
就让这一首歌 陪你走过春夏秋冬
雨下在城市里 心跳声声不停
流行 摇滚 民谣 钢琴 吉他 女声 男声 快乐 悲伤 浪漫
"""


def corpus_lines() -> list[str]:
    lines = [ln for ln in (_CORPUS_EN + _CORPUS_ZH).splitlines() if ln.strip()]
    # Mix lines so that pieces spanning words and punctuation are seen in several contexts.
    mixed = [f"{a} {b}" for a, b in zip(lines, reversed(lines), strict=True)]
    return lines * 4 + mixed * 2


def train_sentencepiece(vocab_size: int) -> bytes:
    """Train the tiny set's tokenizer in memory; deterministic for a given corpus and size."""
    import sentencepiece as spm

    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus_lines()),
        model_writer=out,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        hard_vocab_limit=False,
        user_defined_symbols=list(SPECIAL_TOKENS),
        num_threads=1,
        minloglevel=2,
    )
    return out.getvalue()
