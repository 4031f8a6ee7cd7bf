"""The published release's GPT side: layout discovery, saved args, TE names, RoPE, the launcher's flags.

The release-shaped tiny set (``python -m songserve.pipeline.tiny --layout release``) is built once
per session in a subprocess; the worker runs on it as a real process over real HTTP.
"""

from __future__ import annotations

import argparse
import io
import subprocess

import httpx
import pytest
import soundfile as sf
import torch

from songserve.errors import ConfigError
from tests.support.http import TLS
from tests.support.servers import start_worker

T = 128256  # the Llama-3 text vocabulary of the release


# ---- the layout and formats as written -----------------------------------------------------------


def test_release_set_has_the_release_layout_and_formats(release_dir):
    from torch.distributed.checkpoint import FileSystemReader

    from songserve.pipeline.checkpoints.megatron_args import read_saved_args

    ck = release_dir / "checkpoints"
    assert (release_dir / "models" / "Tokenizer" / "tokenizer.json").is_file()
    assert list((release_dir / "models" / "Decoder").glob("*.yaml"))
    assert list(ck.glob("dac_rvq_*.ckpt"))
    for folder, vocab, padded in (("backbone", 130304, 130432), ("superresolution", 193792, 193920)):
        it = ck / folder / "iter_0000001"
        assert (ck / folder / "latest_checkpointed_iteration.txt").read_text() == "1"
        assert not (ck / folder / "model_config.json").exists()
        keys = FileSystemReader(str(it)).read_metadata().state_dict_metadata
        assert "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight" in keys  # TE names
        assert "decoder.layers.0.mlp.linear_fc1.weight_w" in keys
        assert "decoder.layers.0.mlp.linear_fc1.bias_v" in keys
        assert tuple(keys["embedding.word_embeddings.weight"].size)[0] == padded
        args = read_saved_args(it)
        assert args is not None
        assert args["vocab_size"] == vocab
        assert args["padded_vocab_size"] == padded
        assert args["rotary_base"] == 500000
        assert args["norm_epsilon"] == 1e-6
        assert args["swiglu"]
        assert type(args["attention_backend"]).__name__ == "AttnBackend"


def test_checkpoint_discovery_finds_the_release_paths(release_dir, tmp_path):
    from songserve.pipeline.checkpoints.layout import resolve
    from songserve.worker.settings import WorkerSettings

    for base in (release_dir, release_dir / "checkpoints"):
        c = resolve(WorkerSettings(checkpoints_dir=base))
        assert c.layout == "release"
        assert c.tiny  # built by pipeline/tiny/ (its MANIFEST says so): /config says tiny_checkpoints: true
        assert c.backbones == {"backbone": release_dir / "checkpoints" / "backbone"}
        assert c.superres == {"superresolution": release_dir / "checkpoints" / "superresolution"}
        assert c.tokenizer == release_dir / "models" / "Tokenizer"
        assert c.decoder_config.suffix == ".yaml"
        assert c.decoder_checkpoint.name.startswith("dac_rvq_")
        assert "backbone[backbone]" in c.summary()
    other = tmp_path / "other.yaml"
    other.write_text("x: 1\n")
    c = resolve(
        WorkerSettings(
            checkpoints_dir=release_dir, decoder_config_path=other, backbone_models="bb=checkpoints/backbone"
        )
    )
    assert c.decoder_config == other
    assert c.backbones == {"bb": release_dir / "checkpoints" / "backbone"}
    (tmp_path / "checkpoints" / "superresolution").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"Decoder/\*\.yaml .*DECODER_CONFIG_PATH"):
        resolve(WorkerSettings(checkpoints_dir=tmp_path))
    with pytest.raises(ConfigError, match=r"dac_rvq_\*\.ckpt .*DECODER_CHECKPOINT_PATH"):
        resolve(WorkerSettings(checkpoints_dir=tmp_path, decoder_config_path=other))


# ---- loading ---------------------------------------------------------------------------------------


def test_release_checkpoint_loads_its_saved_architecture(release_dir, megatron_cpu):
    from songserve.pipeline.checkpoints.gpt_load import load_model

    gpt = load_model(release_dir / "checkpoints" / "backbone", megatron_cpu, torch.float32, kind="backbone")
    a = gpt.arch
    assert (a.text_vocab_size, a.vocab_size, a.rows) == (T, 130304, 130432)
    assert (a.position_embedding_type, a.rotary_base, a.normalization, a.norm_epsilon) == (
        "rope",
        500000,
        "RMSNorm",
        1e-6,
    )
    assert a.num_query_groups == 2
    assert a.gated_linear_unit
    assert not a.share_embeddings_and_output_weights
    assert gpt.output_weight.shape[0] == 130432
    assert gpt.load_sec > 0
    sr = load_model(release_dir / "checkpoints" / "superresolution", megatron_cpu, torch.float32, kind="superres")
    assert (sr.arch.text_vocab_size, sr.arch.vocab_size, sr.arch.rows) == (T, 193792, 193920)


def _release_shaped_model(device, **changes):
    from songserve.pipeline.engine.arch import GPTArch
    from songserve.pipeline.engine.gpt import build_model
    from songserve.pipeline.tiny.build import release_arch

    base = release_arch("backbone", 1024).__dict__ | changes
    arch = GPTArch(**base)
    torch.manual_seed(3)
    return arch, build_model(arch, device, torch.float32)


@pytest.mark.parametrize(
    ("legacy", "disk_dtype", "direct"),
    [(False, torch.float32, True), (False, torch.bfloat16, True), (False, torch.float32, False), (True, None, False)],
)
def test_saved_weights_round_trip_through_te_names(megatron_cpu, tmp_path, monkeypatch, legacy, disk_dtype, direct):
    """torch_dist read in place (same dtype, and bf16 files into fp32), megatron's reader, legacy files."""
    from songserve.pipeline.checkpoints import gpt_load as gc_
    from songserve.pipeline.tiny.gpt_write import release_args, save_release_checkpoint

    arch, model = _release_shaped_model(megatron_cpu)
    if disk_dtype is not None:
        model = model.to(disk_dtype)
    used: list[bool] = []
    real = gc_._direct_read
    monkeypatch.setattr(gc_, "_direct_read", lambda r, d: used.append(direct) or (real(r, d) if direct else False))
    save_release_checkpoint(tmp_path / "bb", model, release_args(arch), legacy=legacy)
    if legacy:
        keys = torch.load(tmp_path / "bb" / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
        assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in keys["model"]
    got = gc_.load_model(tmp_path / "bb", megatron_cpu, torch.float32, kind="backbone")
    assert used == ([] if legacy else [direct])
    want = {k: v.float() for k, v in model.state_dict().items() if "_extra_state" not in k}
    have = got.model.state_dict()
    assert all(have[k].dtype == torch.float32 and torch.equal(want[k], have[k]) for k in want)


def test_kv_cached_steps_equal_a_full_forward_with_rope(megatron_cpu):
    from songserve.pipeline.engine.gpt import AcousticGPT
    from songserve.pipeline.engine.oracle import causal_mask, megatron_forward, new_kv_context

    arch, model = _release_shaped_model(megatron_cpu)
    gpt = AcousticGPT(arch, model)
    n, p = 24, 9
    ids = torch.randint(1024, 3072, (1, n, 1), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(n).view(1, -1)
    full = megatron_forward(gpt, ids, pos, causal_mask(n, megatron_cpu))
    ctx = new_kv_context(gpt, n + 4)
    steps = [megatron_forward(gpt, ids[:, :p], pos[:, :p], causal_mask(p, megatron_cpu), ctx)]
    ctx.increment_sequence_len_offset(p)
    for t in range(p, n):
        steps.append(megatron_forward(gpt, ids[:, t : t + 1], pos[:, t : t + 1], None, ctx))
        ctx.increment_sequence_len_offset(1)
    assert (torch.cat(steps) - full).abs().max().item() <= 1e-5
    # RoPE is in play: the same weights with another base compute something else
    arch2, model2 = _release_shaped_model(megatron_cpu, rotary_base=10000)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters(), strict=True))
    other = megatron_forward(AcousticGPT(arch2, model2), ids, pos, causal_mask(n, megatron_cpu))
    assert (other - full).abs().max().item() > 1e-3


# ---- every mapped field family reaches the built model ---------------------------------------------


def _built_from_args(megatron_cpu, **args):
    from songserve.pipeline.checkpoints.megatron_args import arch_fields_from_args
    from songserve.pipeline.engine.arch import GPTArch
    from songserve.pipeline.engine.gpt import build_model

    base = {
        "num_layers": 1,
        "hidden_size": 32,
        "ffn_hidden_size": 64,
        "num_attention_heads": 4,
        "vocab_size": 1024 + 2048,
        "seq_length": 256,
    }
    arch = GPTArch.from_fields(arch_fields_from_args("backbone", base | args, "test"), "test")
    return arch, build_model(arch, megatron_cpu, torch.float32)


def test_norm_epsilon_and_rmsnorm_reach_the_model(megatron_cpu):
    _, m = _built_from_args(megatron_cpu, normalization="RMSNorm", norm_epsilon=1e-6)
    norm = m.decoder.layers[0].input_layernorm
    assert isinstance(norm, torch.nn.RMSNorm)
    assert norm.eps == 1e-6
    assert m.decoder.final_layernorm.eps == 1e-6


def test_rope_base_percent_and_interleave_reach_the_model(megatron_cpu):
    _, m = _built_from_args(
        megatron_cpu, position_embedding_type="rope", rotary_base=500000, rotary_percent=0.5, rotary_interleaved=True
    )
    rope = m.rotary_pos_emb
    dim = 8 // 2  # kv_channels 8, half rotated
    want = 1.0 / (500000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    assert torch.allclose(rope.inv_freq.cpu(), want)
    assert rope.rotary_interleaved


def test_gqa_and_kv_channels_reach_the_model(megatron_cpu):
    _, m = _built_from_args(megatron_cpu, group_query_attention=True, num_query_groups=2, kv_channels=16)
    att = m.decoder.layers[0].self_attention
    assert att.num_query_groups_per_partition == 2
    assert att.key_hidden_size == 16
    assert att.linear_qkv.weight.shape == ((4 + 2 * 2) * 16, 32)
    _, m = _built_from_args(megatron_cpu, num_query_groups=1)  # without --group-query-attention it is ignored
    assert m.decoder.layers[0].self_attention.num_query_groups_per_partition == 4


def test_biases_reach_the_model(megatron_cpu):
    _, m = _built_from_args(megatron_cpu)  # Megatron-LM's default: biases on the dense layers
    layer = m.decoder.layers[0]
    assert layer.self_attention.linear_qkv.bias is not None
    assert layer.mlp.linear_fc2.bias is not None
    _, m = _built_from_args(megatron_cpu, add_bias_linear=False, add_qkv_bias=True)
    layer = m.decoder.layers[0]
    assert layer.self_attention.linear_qkv.bias is not None
    assert layer.self_attention.linear_proj.bias is None
    assert layer.mlp.linear_fc1.bias is None


def test_swiglu_reaches_the_model(megatron_cpu):
    arch, m = _built_from_args(megatron_cpu, swiglu=True)
    mlp = m.decoder.layers[0].mlp
    assert arch.activation_name == "silu"
    assert mlp.config.gated_linear_unit
    assert mlp.linear_fc1.weight.shape == (2 * 64, 32)
    assert mlp.config.activation_func is torch.nn.functional.silu


def test_qk_layernorm_reaches_the_model(megatron_cpu):
    _, m = _built_from_args(megatron_cpu, qk_layernorm=True, normalization="RMSNorm", norm_epsilon=1e-6)
    att = m.decoder.layers[0].self_attention
    assert att.q_layernorm is not None
    assert att.q_layernorm.eps == 1e-6
    assert att.k_layernorm.weight.shape == (8,)


def test_layernorm_1p_reaches_the_model(megatron_cpu):
    from songserve.pipeline.engine.gpt import ZeroCenteredNorm

    _, m = _built_from_args(megatron_cpu, apply_layernorm_1p=True, norm_epsilon=1e-6)
    norm = m.decoder.layers[0].input_layernorm
    assert isinstance(norm, ZeroCenteredNorm)
    assert isinstance(m.decoder.final_layernorm, ZeroCenteredNorm)
    x = torch.randn(3, 32)
    torch.nn.init.zeros_(norm.weight)  # stored gamma − 1 = 0 → plain layer norm
    assert torch.allclose(norm(x), torch.nn.functional.layer_norm(x, (32,), eps=1e-6), atol=1e-6)


def test_untied_output_reaches_the_model(megatron_cpu):
    _, m = _built_from_args(megatron_cpu, untie_embeddings_and_output_weights=True)
    assert m.output_layer.weight is not None
    assert not m.share_embeddings_and_output_weights
    _, m = _built_from_args(megatron_cpu)
    assert m.share_embeddings_and_output_weights


# ---- refusals and overrides -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_experts", 8), ("multi_latent_attention", True), ("window_size", (128, 0)), ("normalization", "L2Norm")],
)
def test_unsupported_math_refuses_naming_field_and_value(field, value):
    from songserve.pipeline.checkpoints.megatron_args import arch_fields_from_args

    args = {"num_layers": 1, "hidden_size": 8, "ffn_hidden_size": 8, "num_attention_heads": 1, "vocab_size": 4096}
    with pytest.raises(ConfigError, match=f"{field}={value!r}".replace("(", r"\(").replace(")", r"\)")) as exc:
        arch_fields_from_args("backbone", args | {"seq_length": 8, field: value}, "saved args of X")
    assert "\n" not in str(exc.value)


def test_missing_saved_arg_refuses_naming_it(tmp_path):
    from songserve.pipeline.checkpoints.gpt_load import resolve_arch

    it = tmp_path / "bb" / "iter_0000001"
    it.mkdir(parents=True)
    (tmp_path / "bb" / "latest_checkpointed_iteration.txt").write_text("1")
    ns = argparse.Namespace(num_layers=2, hidden_size=8, ffn_hidden_size=8, vocab_size=4096, seq_length=64)
    torch.save({"args": ns}, it / "common.pt")
    with pytest.raises(ConfigError, match="'num_attention_heads'") as exc:
        resolve_arch(tmp_path / "bb", "backbone")
    assert "\n" not in str(exc.value)
    torch.save({"args": ns, "evil": subprocess.Popen}, it / "common.pt")  # a class outside the allow-list
    with pytest.raises(ConfigError, match="could not be read safely"):
        resolve_arch(tmp_path / "bb", "backbone")


def test_a_tensor_the_model_needs_and_the_file_lacks_refuses_naming_it(release_dir, megatron_cpu):
    from songserve.pipeline.checkpoints.gpt_load import load_model

    with pytest.raises(ConfigError, match=r"has no tensor 'decoder\.layers\.2\.") as exc:
        load_model(release_dir / "checkpoints" / "backbone", megatron_cpu, torch.float32, "--num-layers 3", "backbone")
    assert "\n" not in str(exc.value)
    with pytest.raises(ConfigError, match=r"linear_proj.weight is \[32, 32\] in the file, \[32, 64\]"):
        load_model(
            release_dir / "checkpoints" / "backbone", megatron_cpu, torch.float32, "--kv-channels 16", "backbone"
        )


def test_flags_override_saved_args(release_dir):
    from songserve.pipeline.checkpoints.gpt_load import resolve_arch

    flags = (
        "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --tokenizer-type NullTokenizer "
        "--norm-epsilon 1e-5 --num-tokens-to-generate 23552 --inference-max-seq-length 25600 --stream "
        "--enable-cuda-graph --flash-decode --bf16"
    )
    arch, _ = resolve_arch(release_dir / "checkpoints" / "backbone", "backbone", flags)
    assert arch.norm_epsilon == 1e-5
    assert arch.inference_max_seq_length == 25600
    with pytest.raises(ConfigError, match="tensor-model-parallel-size 2"):
        resolve_arch(release_dir / "checkpoints" / "backbone", "backbone", "--tensor-model-parallel-size 2")
    with pytest.raises(ConfigError, match="num_experts=4"):
        resolve_arch(release_dir / "checkpoints" / "backbone", "backbone", "--num-experts 4")


def test_launcher_command_line_splits_into_worker_and_megatron_flags():
    from songserve.worker.main import split_megatron_flags

    own, meg = split_megatron_flags(
        ["--worker-port", "8001", "--runtime-mode", "one_shot", "--seed", "7", "--norm-epsilon", "1e-6", "--bf16"]
    )
    assert own == ["--worker-port", "8001", "--runtime-mode", "one_shot", "--seed", "7"]
    assert meg == ["--norm-epsilon", "1e-6", "--bf16"]


# ---- the real worker on the release-shaped set ------------------------------------------------------


def _five_seconds(worker) -> dict:
    body = {"lyrics": "[verse]\nhello world", "tags": "pop, piano", "duration": 5 / 60, "seed_override": 5}
    r = httpx.post(worker.url + "/generate", json=body, timeout=300, verify=TLS)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["status"] == "ok", out
    wav = httpx.get(f"{worker.url}/download/{out['wav_filename']}", timeout=30, verify=TLS).content
    audio, sr = sf.read(io.BytesIO(wav))
    assert sr == 44100
    assert audio.shape[1] == 2
    assert 0 < audio.shape[0] / sr <= 5.0 + 2048 / 44100
    return out


def test_worker_serves_the_release_set_with_only_checkpoints_dir(release_dir, tmp_path):
    w = start_worker(tmp_path, "--runtime-mode", "one_shot", env={"CHECKPOINTS_DIR": str(release_dir)})
    try:
        health = w.wait_healthy(timeout=300)
        assert set(health["load_sec"]) == {"backbone", "superres", "decoder", "encoder"}  # the encoder too (uploads)
        assert health["backbone_models"] == ["backbone"]
        assert not health["superres_loaded"]
        cfg = httpx.get(w.url + "/config", timeout=10, verify=TLS).json()
        assert cfg["checkpoint_layout"] == "release"
        assert cfg["superres_models"] == ["superresolution"]
        assert cfg["checkpoints"]["tokenizer"].endswith("models/Tokenizer")
        assert cfg["architectures"]["backbone"]["text_vocab"] == T
        out = _five_seconds(w)
        meta = httpx.get(f"{w.url}/download/{out['json_filename']}", timeout=30, verify=TLS).json()
        assert meta["load_sec"]["superres"] > 0
        assert meta["models"]["superres"] == "superresolution"
        assert "checkpoint set (release layout)" in w.log_tail(200_000)
    finally:
        w.stop()


def test_vocab_tokenizer_mismatch_refuses_at_start(release_dir, tmp_path, tiny_dir):
    w = start_worker(
        tmp_path,
        env={"CHECKPOINTS_DIR": str(release_dir), "TOKENIZER_PATH": str(tiny_dir / "tokenizer")},
    )
    code = w.proc.wait(300)
    log = w.log_tail(200_000)
    w.stop()
    assert code == 2, log
    assert "text vocabulary 128256" in log
    assert "tokenizer's" in log


def test_one_shot_drops_every_superres_reference_before_releasing_memory(tiny_dir, megatron_cpu, tmp_path, monkeypatch):
    import gc
    import weakref

    from songserve.pipeline import pipeline as pl
    from songserve.pipeline import residency
    from songserve.pipeline.checkpoints.layout import resolve
    from songserve.pipeline.context import TaskContext
    from songserve.pipeline.types import TrackRequest
    from songserve.worker.settings import WorkerSettings

    s = WorkerSettings(output_dir=tmp_path, runtime_mode="one_shot")
    pipe = pl.ModelPipeline(s, resolve(s), megatron_cpu)
    refs: list[weakref.ref] = []
    load = pipe.residency._gpt

    def tracked(path, kind, name):
        gpt = load(path, kind, name)
        if kind == "superres":
            refs.append(weakref.ref(gpt.model))
        return gpt

    alive_at_release: list[int] = []

    def release(device):
        gc.collect()
        alive_at_release.append(sum(r() is not None for r in refs))

    monkeypatch.setattr(pipe.residency, "_gpt", tracked)
    monkeypatch.setattr(residency, "release_memory", release)
    pipe.load()
    r = pipe.run(TrackRequest(lyrics="la", tags="pop", duration=1 / 60, seed=1, task_id="t"), TaskContext("t"))
    assert len(refs) == 2
    assert alive_at_release == [0, 0]
    assert set(r.metadata["load_sec"]) == {"backbone", "superres", "decoder", "encoder"}
