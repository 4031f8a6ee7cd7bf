"""Each pipeline stage with the tiny set: shapes, vocabulary windows, masks, formats."""

from __future__ import annotations

import json
import math

import pytest
import torch

from songserve.errors import ConfigError, TaskCancelled
from songserve.pipeline.checkpoints.gpt_load import load_model
from songserve.pipeline.context import TaskContext
from songserve.pipeline.engine.arch import GPTArch, parse_megatron_args
from songserve.pipeline.engine.oracle import causal_mask, megatron_forward, new_kv_context
from songserve.pipeline.stages import tokenizer as tk
from songserve.pipeline.stages.backbone import Backbone
from songserve.pipeline.stages.codec import (
    AudioDecoder,
    DecoderConfig,
    fold_weight_norm,
    load_decoder,
    weight_norm_state,
)
from songserve.pipeline.stages.prompt import PromptRequest, build_prompt
from songserve.pipeline.stages.superres import SuperRes


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return tk.load_tokenizer(tiny_dir / "tokenizer")


@pytest.fixture(scope="module")
def backbone(tiny_dir, tok, megatron_cpu):
    return Backbone(load_model(tiny_dir / "backbone", megatron_cpu, torch.float32), tok.token_id(tk.EOD))


@pytest.fixture(scope="module")
def superres(tiny_dir, megatron_cpu):
    return SuperRes(load_model(tiny_dir / "superres", megatron_cpu, torch.float32))


# ---- tokenizer ------------------------------------------------------------------------------------


def test_tokenizer_round_trips_lyrics_and_keeps_special_tokens_whole(tok):
    text = "[verse]\n月光洒在窗前，我想起你 ★ 🎵 ＡＢＣ don't stop"
    assert tok.decode(tok.encode(text)) == text
    for piece in tk.SPECIAL_TOKENS:
        assert tok.encode(piece) == [tok.token_id(piece)]


def test_hf_tokenizer_json_directory_is_loaded_by_what_the_path_holds(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    hf = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.add_special_tokens(list(tk.SPECIAL_TOKENS))
    hf.save(str(tmp_path / "tokenizer.json"))
    loaded = tk.load_tokenizer(tmp_path)
    assert isinstance(loaded, tk.HFTokenizer)
    assert loaded.encode("hello world") == [1, 2]
    assert loaded.token_id(tk.BOA) == 3 + tk.SPECIAL_TOKENS.index(tk.BOA)


def test_tokenizer_errors_name_the_path(tmp_path):
    with pytest.raises(ConfigError, match=str(tmp_path / "nope")):
        tk.load_tokenizer(tmp_path / "nope")
    with pytest.raises(ConfigError, match="neither tokenizer.json nor tokenizer.model"):
        tk.load_tokenizer(tmp_path)


# ---- prompt ---------------------------------------------------------------------------------------


def test_vocal_prompt_layout(tok):
    ids = build_prompt(tok, PromptRequest("pop, piano", "line one\nline two", 3.0), 4096)
    sid = tok.token_id
    assert ids[0] == sid(tk.BOS)
    assert ids[-3:] == [sid(tk.duration_token(3)), sid(tk.EOT), sid(tk.BOA)]
    text = tok.decode(ids)
    assert f"pop, piano{tk.EOM}{tk.EOM}{tk.BOL}{tk.EOL}line one{tk.EOL}line two{tk.EOM}" in text


def test_instrumental_prompt_has_language_and_no_lyrics_block(tok):
    ids = build_prompt(tok, PromptRequest("jazz", "ignored", 1.0, instrumental=True), 4096)
    text = tok.decode(ids)
    assert "Instrumental" in text
    assert tk.BOL not in text
    assert "ignored" not in text


@pytest.mark.parametrize("limit", [12, 20, 64])
def test_shortening_keeps_duration_and_closing_tokens(tok, limit):
    ids = build_prompt(tok, PromptRequest("rock " * 50, "la la la\n" * 200, 2.0), limit)
    sid = tok.token_id
    assert len(ids) == limit
    assert ids[0] == sid(tk.BOS)
    assert ids[-4:] == [sid(tk.EOM), sid(tk.duration_token(2)), sid(tk.EOT), sid(tk.BOA)]
    assert sid(tk.BOL) in ids
    assert sid(tk.EOL) in ids


# ---- backbone -------------------------------------------------------------------------------------


def _gen(backbone, frames, seed, **kw):
    g = torch.Generator().manual_seed(seed)
    prompt = list(range(3, 23))
    return backbone.generate(
        prompt,
        frames,
        top_k=kw.pop("top_k", 50),
        temperature=1.0,
        generator=g,
        ctx=kw.pop("ctx", TaskContext("t")),
        **kw,
    )


def test_backbone_codes_are_in_the_codebook_window_and_seeded(backbone):
    a = _gen(backbone, 40, seed=1)
    b = _gen(backbone, 40, seed=1)
    c = _gen(backbone, 40, seed=2)
    assert a.codes.shape == (2, 40)
    assert a.stopped_by == "budget"
    assert a.new_tokens == 80
    assert int(a.codes.min()) >= 0
    assert int(a.codes.max()) < 1024
    assert torch.equal(a.codes, b.codes)
    assert not torch.equal(a.codes, c.codes)


def test_kv_cached_steps_match_a_full_causal_forward(backbone):
    gpt = backbone.gpt
    ids = torch.randint(0, gpt.arch.vocab_size, (1, 30, 1))
    pos = torch.arange(30).view(1, -1)
    with torch.inference_mode():
        full = megatron_forward(gpt, ids, pos, causal_mask(30, gpt.device))[:, 0]
        cache = new_kv_context(gpt, 30)
        steps = [megatron_forward(gpt, ids[:, :10], pos[:, :10], causal_mask(10, gpt.device), cache)[:, 0]]
        cache.increment_sequence_len_offset(10)
        for i in range(10, 30):
            steps.append(megatron_forward(gpt, ids[:, i : i + 1], pos[:, i : i + 1], None, cache)[:, 0])
            cache.increment_sequence_len_offset(1)
    assert torch.allclose(torch.cat(steps), full, atol=1e-5)


@pytest.mark.parametrize("kind", ["backbone", "superres"])
def test_bf16_model_is_bf16_throughout_and_the_step_matches_megatron(tiny_dir, megatron_cpu, kind):
    """As Megatron-LM's Float16Module: norms and the position table too (megatron builds them fp32),
    so megatron's own bf16 forward runs, and the decode step agrees with it to bf16 rounding."""
    from songserve.pipeline.engine.transformer import DecodeModel

    gpt = load_model(tiny_dir / kind, megatron_cpu, torch.bfloat16)
    assert {p.dtype for p in gpt.model.parameters()} == {torch.bfloat16}
    dm = DecodeModel(gpt.model, gpt.output_weight)
    ids = torch.randint(0, gpt.arch.vocab_size, (1, 24))
    pos = torch.arange(24).view(1, -1)
    with torch.inference_mode():
        ref = megatron_forward(gpt, ids.unsqueeze(-1), pos, causal_mask(24, megatron_cpu))[:, 0].float()
        got = dm.forward(dm.embed(ids.unsqueeze(-1), pos))[0].float()
    assert got.dtype == ref.dtype
    assert (got - ref).abs().max().item() < 0.1  # bf16 rounding


def test_end_of_audio_is_accepted_only_after_the_minimum_share(backbone, monkeypatch):
    gpt = backbone.gpt
    real_project = gpt.project

    def eod_dominates(hidden, start, stop):  # the end-of-document row always wins when offered
        logits = real_project(hidden, start, stop)
        return logits + 1e4 if (start, stop) == (backbone.eod_id, backbone.eod_id + 1) else logits

    monkeypatch.setattr(gpt, "project", eod_dominates)
    r = _gen(backbone, 40, seed=3, min_share=0.5, top_k=1025)
    assert r.stopped_by == "end_of_audio"
    assert r.codes.shape[1] == math.ceil(0.5 * 40)
    r = _gen(backbone, 40, seed=3, min_share=1.0, top_k=1025)
    assert r.stopped_by == "budget"
    assert r.codes.shape[1] == 40


def test_backbone_stops_at_a_cancellation_check(backbone):
    ctx = TaskContext("t")
    ctx.cancel()
    with pytest.raises(TaskCancelled):
        _gen(backbone, 40, seed=1, ctx=ctx)


# ---- super-resolution -----------------------------------------------------------------------------


def test_superres_fills_levels_2_to_63_and_keeps_the_coarse_codes(superres, backbone):
    coarse = _gen(backbone, 25, seed=4).codes
    ctx = TaskContext("t")
    codes = superres.generate(list(range(3, 15)), coarse, top_k=10, generator=torch.Generator().manual_seed(1), ctx=ctx)
    assert codes.shape == (64, 25)
    assert torch.equal(codes[:2], coarse)
    assert int(codes.min()) >= 0
    assert int(codes.max()) < 1024
    assert ctx.snapshot().done == 62


def test_superres_is_non_causal(superres):
    gpt = superres.gpt
    grid = torch.randint(0, gpt.arch.text_vocab_size, (1, 12, 64))
    grid[:, :, 1:] = -1
    pos = torch.arange(12).view(1, -1)
    from songserve.pipeline.engine.oracle import full_mask

    with torch.inference_mode():
        a = megatron_forward(gpt, grid, pos, full_mask(12, gpt.device))
        grid2 = grid.clone()
        grid2[0, -1, 0] = (grid2[0, -1, 0] + 1) % gpt.arch.text_vocab_size
        b = megatron_forward(gpt, grid2, pos, full_mask(12, gpt.device))
    assert not torch.allclose(a[0], b[0])  # the first row sees the last one


def test_superres_windows_long_songs(superres, backbone):
    import dataclasses

    small = SuperRes(superres.gpt)
    small.gpt = type(superres.gpt).__new__(type(superres.gpt))
    small.gpt.__dict__.update(superres.gpt.__dict__)
    small.gpt.arch = dataclasses.replace(superres.gpt.arch, max_sequence_length=22)
    coarse = _gen(backbone, 25, seed=5).codes
    codes = small.generate(
        list(range(3, 15)), coarse, top_k=10, generator=torch.Generator().manual_seed(1), ctx=TaskContext("t")
    )
    assert codes.shape == (64, 25)
    assert torch.equal(codes[:2], coarse)


# ---- decoder --------------------------------------------------------------------------------------


def test_decoder_loads_tiny_set_and_has_the_configured_shape(tiny_dir):
    decoder = load_decoder(
        tiny_dir / "decoder" / "config.yaml", tiny_dir / "decoder" / "model.pth", torch.device("cpu")
    )
    assert decoder.cfg.hop == 2048
    assert decoder.cfg.channels == 2
    assert decoder.cfg.n_codebooks == 64
    wave = decoder.decode(torch.randint(0, 1024, (1, 64, 7)), chunk_frames=0)
    assert wave.shape == (1, 2, 7 * 2048)


def test_chunked_decode_equals_one_pass(tiny_dir):
    decoder = load_decoder(
        tiny_dir / "decoder" / "config.yaml", tiny_dir / "decoder" / "model.pth", torch.device("cpu")
    )
    codes = torch.randint(0, 1024, (1, 64, 100), generator=torch.Generator().manual_seed(0))
    one = decoder.decode(codes, chunk_frames=0)
    chunked = decoder.decode(codes, chunk_frames=24, context_frames=16)
    seams = decoder.decode(codes, chunk_frames=24, context_frames=0)
    diff = (one - chunked).abs().max().item()
    assert diff < 1e-5, diff
    assert (one - seams).abs().max().item() > 100 * max(diff, 1e-7)  # context is what makes it exact


def test_weight_norm_old_and_new_names_fold_to_the_same_weights():
    torch.manual_seed(0)
    cfg = DecoderConfig(latent_dim=8, n_filters=2, rates=(2, 2), n_codebooks=2, codebook_size=16)
    decoder = AudioDecoder(cfg)
    old = weight_norm_state(decoder.state_dict())
    new = {
        k.replace(".weight_g", ".parametrizations.weight.original0").replace(
            ".weight_v", ".parametrizations.weight.original1"
        ): v
        for k, v in old.items()
    }
    a, b = fold_weight_norm(old), fold_weight_norm(new)
    for k, v in decoder.state_dict().items():
        assert torch.allclose(a[k], v, atol=1e-6)
        assert torch.allclose(b[k], v, atol=1e-6)


def test_decoder_strict_keys_and_dac_format(tmp_path):
    import yaml

    cfg = DecoderConfig(latent_dim=8, n_filters=2, rates=(2, 2), n_codebooks=2, codebook_size=16)
    decoder = AudioDecoder(cfg)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg.to_yaml_dict()))
    state = {f"generator.{k}": v for k, v in weight_norm_state(decoder.state_dict()).items()}
    state["generator.encoder.block.0.weight"] = torch.zeros(1)  # encoder weights are skipped
    torch.save({"state_dict": state}, tmp_path / "ok.pth")
    loaded = load_decoder(tmp_path / "c.yaml", tmp_path / "ok.pth", torch.device("cpu"))
    codes = torch.randint(0, 16, (1, 2, 5))
    assert torch.allclose(loaded.decode(codes, 0), decoder.decode(codes, 0), atol=1e-5)

    del state["generator.decoder.model.0.bias"]
    torch.save({"state_dict": state}, tmp_path / "bad.pth")
    with pytest.raises(ConfigError, match="bad.pth does not match"):
        load_decoder(tmp_path / "c.yaml", tmp_path / "bad.pth", torch.device("cpu"))

    dac_cfg = DecoderConfig.from_dac_kwargs(
        {
            "latent_dim": 8,
            "decoder_dim": 8,
            "decoder_rates": [2, 2],
            "n_codebooks": 2,
            "codebook_size": 16,
            "codebook_dim": 4,
        }
    )
    dac = AudioDecoder(dac_cfg)
    torch.save(
        {
            "state_dict": weight_norm_state(dac.state_dict()),
            "metadata": {
                "kwargs": {
                    "latent_dim": 8,
                    "decoder_dim": 8,
                    "decoder_rates": [2, 2],
                    "n_codebooks": 2,
                    "codebook_size": 16,
                    "codebook_dim": 4,
                }
            },
        },
        tmp_path / "dac.pth",
    )
    loaded = load_decoder(tmp_path / "none.yaml", tmp_path / "dac.pth", torch.device("cpu"))
    assert torch.allclose(loaded.decode(codes, 0), dac.decode(codes, 0), atol=1e-5)


# ---- checkpoints and configuration ----------------------------------------------------------------


def test_megatron_args_override_the_model_config():
    got = parse_megatron_args("--num-layers 24 --hidden-size 2048 --swiglu --seq-length 25600 --bf16")
    assert got == {"num_layers": 24, "hidden_size": 2048, "gated_linear_unit": True, "max_sequence_length": 25600}


def test_mismatched_checkpoint_refuses_with_the_path(tiny_dir, tmp_path, megatron_cpu):
    import shutil

    bad = tmp_path / "backbone"
    shutil.copytree(tiny_dir / "backbone", bad)
    cfg = json.loads((bad / "model_config.json").read_text())
    cfg["hidden_size"] = 128
    (bad / "model_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=str(bad)):
        load_model(bad, megatron_cpu, torch.float32)
    with pytest.raises(ConfigError, match="does not exist"):
        load_model(tmp_path / "missing", megatron_cpu, torch.float32)


def test_tiny_set_is_deterministic(tiny_dir, tmp_path):
    from tests.support import zygote
    from tests.support.servers import ROOT

    out = tmp_path / "again"
    # a process of its own (its own hash seed and generators), forked from the template that has torch
    # and megatron-core imported: the build, not the imports, is what is compared
    built = zygote.run("torch", ["-m", "songserve.pipeline.tiny", "--out", str(out)], ROOT, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    assert (out / "tokenizer" / "tokenizer.model").read_bytes() == (
        tiny_dir / "tokenizer" / "tokenizer.model"
    ).read_bytes()
    assert (out / "decoder" / "model.pth").read_bytes() == (tiny_dir / "decoder" / "model.pth").read_bytes()
    a = torch.load(out / "decoder" / "model.pth")["state_dict"]
    assert all(k.startswith("generator.") for k in a)
    assert any(k.endswith("weight_g") for k in a)
    assert GPTArch.from_dir(out / "backbone") == GPTArch.from_dir(tiny_dir / "backbone")


@pytest.mark.parametrize("groups", [None, 2])
def test_fused_core_attention_matches_megatrons(megatron_cpu, groups):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from songserve.pipeline.engine.gpt import AcousticGPT, build_model
    from songserve.pipeline.engine.oracle import full_mask

    arch = GPTArch("backbone", 2, 64, 4, 256, 1024, 3072, 128, 64, num_query_groups=groups)
    model = build_model(arch, megatron_cpu, torch.float32)
    gpt = AcousticGPT(arch, model)
    ids = torch.randint(0, 3072, (1, 40, 1))
    pos = torch.arange(40).view(1, -1)
    with torch.inference_mode():
        ours = [megatron_forward(gpt, ids, pos, m(40, megatron_cpu)) for m in (causal_mask, full_mask)]
        for layer in model.decoder.layers:
            layer.self_attention.core_attention.__class__ = DotProductAttention  # megatron's own arithmetic
        theirs = [megatron_forward(gpt, ids, pos, m(40, megatron_cpu)) for m in (causal_mask, full_mask)]
    for a, b in zip(ours, theirs, strict=True):
        assert torch.allclose(a, b, atol=1e-5)
