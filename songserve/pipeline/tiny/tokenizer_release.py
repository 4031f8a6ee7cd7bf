"""Write a tokenizer folder shaped like the release's ``models/Tokenizer/`` (Llama-3.1's layout).

``tokenizer.json`` is a byte-level BPE built with the ``tokenizers`` library: a small BPE trained on
the built-in lyric corpus (``tokenizer.corpus_lines()``), its vocabulary padded with unreachable
filler entries to 128,000 ordinary ids, then Llama-3.1's 256 special tokens at 128,000–128,255:

    128000 <|begin_of_text|>   128001 <|end_of_text|>   128002/128003 <|reserved_special_token_0/1|>
    128004 <|finetune_right_pad_id|>   128005 <|reserved_special_token_2|>
    128006 <|start_header_id|>   128007 <|end_header_id|>   128008 <|eom_id|>   128009 <|eot_id|>
    128010 <|python_tag|>   128011… <|reserved_special_token_3…247|>

so the duration tokens (``reserved_special_token_0..15``) are not consecutive ids, as in the release.
Beside it: ``tokenizer_config.json`` (``added_tokens_decoder``, BOS/EOS, the tokenizer class) and
``special_tokens_map.json``. Deterministic; about a second; ~2.5 MB on disk (the filler entries).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from songserve.pipeline.stages.tokenizer import BOS, EOD, corpus_lines

ORDINARY_IDS = 128000
TOTAL_IDS = 128256
BPE_TRAINED = 2000  # ordinary tokens learned from the corpus; the rest up to 128,000 are fillers
# Llama-3's pre-tokenisation pattern (contractions, letters, 1–3 digits, punctuation runs, spaces).
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_FILLER = "\u2205"  # not in the byte-level alphabet: a filler entry can never be produced by encoding


def llama3_special_tokens() -> list[str]:
    """Names of ids 128000..128255 in Llama-3.1's order."""
    named = {
        0: BOS,
        1: EOD,
        4: "<|finetune_right_pad_id|>",
        6: "<|start_header_id|>",
        7: "<|end_header_id|>",
        8: "<|eom_id|>",
        9: "<|eot_id|>",
        10: "<|python_tag|>",
    }
    out, reserved = [], 0
    for i in range(TOTAL_IDS - ORDINARY_IDS):
        if i in named:
            out.append(named[i])
        else:
            out.append(f"<|reserved_special_token_{reserved}|>")
            reserved += 1
    return out


def _trained_bpe() -> dict[str, Any]:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_TRAINED,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus_lines(), trainer=trainer)
    doc: dict[str, Any] = json.loads(tok.to_str())
    return doc


def _added(token_id: int, content: str) -> dict[str, Any]:
    return {
        "id": token_id,
        "content": content,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": True,
    }


def write_release_tokenizer(folder: Path) -> int:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``; return 128256."""
    doc = _trained_bpe()
    vocab: dict[str, int] = doc["model"]["vocab"]
    if len(vocab) > ORDINARY_IDS or sorted(vocab.values()) != list(range(len(vocab))):
        raise AssertionError("the trained BPE vocabulary is not dense")
    for i in range(len(vocab), ORDINARY_IDS):
        vocab[f"{_FILLER}{i:x}"] = i
    specials = llama3_special_tokens()
    doc["added_tokens"] = [_added(ORDINARY_IDS + i, s) for i, s in enumerate(specials)]
    doc["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [
            {"SpecialToken": {"id": BOS, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": BOS, "type_id": 1}},
            {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {BOS: {"id": BOS, "ids": [ORDINARY_IDS], "tokens": [BOS]}},
    }
    config = {
        # Keys in the order the release's file has them (alphabetical), so the file is byte-identical.
        "added_tokens_decoder": {str(a["id"]): {k: a[k] for k in sorted(a) if k != "id"} for a in doc["added_tokens"]},
        "bos_token": BOS,
        "clean_up_tokenization_spaces": True,
        "eos_token": EOD,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    folder.mkdir(parents=True, exist_ok=True)
    files = {
        "tokenizer.json": json.dumps(doc, ensure_ascii=False, separators=(",", ":")),
        "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False) + "\n",
        "special_tokens_map.json": json.dumps({"bos_token": BOS, "eos_token": EOD}, indent=2) + "\n",
    }
    for name, text in files.items():
        tmp = folder / f".{name}.tmp"
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, folder / name)
    return TOTAL_IDS
