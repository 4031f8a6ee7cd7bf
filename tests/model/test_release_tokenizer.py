"""The tokenizer folder as released (Llama-3.1 layout): ids by name, config checks, the vocab check."""

from __future__ import annotations

import json

import pytest

from songserve.errors import ConfigError
from songserve.pipeline.stages import tokenizer as tk
from songserve.pipeline.stages.prompt import PromptRequest, build_prompt
from songserve.pipeline.tiny.tokenizer_release import write_release_tokenizer

LLAMA31 = {
    tk.BOS: 128000,
    tk.EOD: 128001,
    tk.BOL: 128006,
    tk.EOL: 128007,
    tk.EOM: 128008,
    tk.EOT: 128009,
    tk.BOA: 128010,
}
DURATION_IDS = [128002, 128003, 128005, *range(128011, 128024)]  # reserved_special_token_0..15


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("tokenizer")
    assert write_release_tokenizer(d) == 128256
    return d


@pytest.fixture(scope="module")
def tok(folder):
    return tk.load_tokenizer(folder)


def test_folder_holds_the_released_files_small_and_deterministic(folder, tmp_path):
    names = {p.name for p in folder.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= names
    assert (folder / "tokenizer.json").stat().st_size < 4_000_000
    write_release_tokenizer(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / name).read_bytes() == (folder / name).read_bytes()
    assert json.loads((folder / "special_tokens_map.json").read_text())["bos_token"] == tk.BOS


def test_special_tokens_sit_at_their_llama31_ids_by_name(tok):
    assert isinstance(tok, tk.HFTokenizer)
    assert tok.vocab_size == 128256
    ids = tk.special_token_ids(tok)
    for piece, want in LLAMA31.items():
        assert ids[piece] == want, piece
    assert [ids[tk.duration_token(m)] for m in range(16)] == DURATION_IDS
    assert tok.token_id("<|reserved_special_token_247|>") == 128255


def test_lyrics_round_trip_and_ordinary_text_never_yields_special_ids(tok):
    text = "[verse]\n月光洒在窗前，我想起你 ★ 🎵 don't stop 2026\n[chorus]"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert max(ids) < 128000
    for piece in tk.SPECIAL_TOKENS:
        assert tok.encode(piece) == [tok.token_id(piece)]


def test_prompt_uses_the_named_ids(tok):
    ids = build_prompt(tok, PromptRequest(style="pop", lyrics="hello\nworld", duration_min=2.5), 4096)
    assert ids[0] == 128000
    assert ids[-3:] == [DURATION_IDS[3], 128009, 128010]  # 3 minutes → reserved_special_token_3 = 128011
    assert ids.count(128007) == 2  # EOL after BOL and between the two lines


def test_text_vocab_check_returns_the_size_or_refuses_in_one_line(tok):
    assert tk.check_text_vocab(tok, 128256, "backbone") == 128256
    with pytest.raises(ConfigError, match="has 128256 ids, but model backbone has a text vocabulary of 128000") as err:
        tk.check_text_vocab(tok, 128000, "backbone")
    assert "\n" not in str(err.value)


def _copy(folder, dest):
    for p in folder.iterdir():
        (dest / p.name).write_bytes(p.read_bytes())
    return dest


def test_config_disagreeing_with_tokenizer_json_refuses_naming_the_token(folder, tmp_path):
    d = _copy(folder, tmp_path)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["added_tokens_decoder"]["128009"]["content"] = tk.BOA
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"lists <\|python_tag\|> at id 128009, but tokenizer.json has it at 128010"):
        tk.load_tokenizer(d)


def test_config_with_unknown_bos_refuses(folder, tmp_path):
    d = _copy(folder, tmp_path)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["bos_token"] = "<s>"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="bos_token <s> is not in tokenizer.json"):
        tk.load_tokenizer(d)


def test_a_tokenizer_without_a_duration_token_refuses_naming_it(folder, tmp_path):
    d = _copy(folder, tmp_path)
    (d / "tokenizer_config.json").unlink()
    doc = json.loads((d / "tokenizer.json").read_text(encoding="utf-8"))
    for a in doc["added_tokens"]:
        if a["content"] == "<|reserved_special_token_15|>":
            a["content"] = "<|renamed|>"
    (d / "tokenizer.json").write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"has no special token <\|reserved_special_token_15\|>"):
        tk.load_tokenizer(d)
