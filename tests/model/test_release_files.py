"""Conformance with the published release's own small files, held here exactly as the reference has them.

``tests/fixtures/khala/`` holds, byte for byte, the files of the reference repository
(Khala-Music-AI/Khala at ``REFERENCE_COMMIT``) that the worker reads beside the weights: the
decoder's golden YAML and the tokenizer's ``tokenizer_config.json`` / ``special_tokens_map.json``
(its ``tokenizer.json`` is not in the public snapshot). Each is checked against the reference's git
blob id, loaded through the code the worker uses, and compared with what our release-shaped tiny set
writes. The built-in ``/tags`` catalogue is the reference's ``backend/tags.json`` and is checked the
same way. Last, the reference launcher's full worker command line starts a real worker, whose
``--num-tokens-to-generate`` sets the backbone's budget.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import shutil
from pathlib import Path

import httpx
import pytest
import soundfile as sf

from songserve.api.http import tags as tag_catalogue
from songserve.errors import ConfigError
from songserve.pipeline.checkpoints.decoder_config import read_decoder_config
from songserve.pipeline.stages.tokenizer import BOS, EOD, duration_token, load_tokenizer
from songserve.pipeline.tiny.decoder_release import FULL_SIZES, release_yaml
from songserve.pipeline.tiny.tokenizer_release import write_release_tokenizer
from songserve.process.settings import load_settings
from songserve.worker.launcher_flags import apply_launcher_flags, verdict
from songserve.worker.settings import WorkerSettings
from tests.support.http import TLS
from tests.support.servers import start_worker

REFERENCE_COMMIT = "f3992801722e78890d10470e32d821b52631024e"  # 2026-05-16, "Fix frontend progress display state"
FIXTURES = Path(__file__).parents[1] / "fixtures" / "khala"
GOLDEN = FIXTURES / "models" / "Decoder" / "dac_rvq_1024_64_golden.yaml"
TOKENIZER = FIXTURES / "models" / "Tokenizer"
# ``git ls-tree <REFERENCE_COMMIT>`` of the reference repository: the blob id of each file.
REFERENCE_BLOBS = {
    GOLDEN: "7497e2f0d0cfa579442f29697efe8172ee8d5117",
    TOKENIZER / "tokenizer_config.json": "cb9ec25536e44d86778b10509d3e5bdca459a5cf",
    TOKENIZER / "special_tokens_map.json": "d8cd5076496dbe4be2320312abc10adc43097b81",
    tag_catalogue.BUILTIN: "1650d084be8173d93ded82222bf02a2abed1d819",  # backend/tags.json
}
# The reference launcher's worker command line (backend/run_backend.sh), its MEGATRON_ARGS unchanged.
LAUNCHER_MEGATRON_ARGS = (
    "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --tokenizer-type NullTokenizer "
    "--norm-epsilon 1e-6 --num-tokens-to-generate 23552 --inference-max-seq-length 25600 --stream "
    "--enable-cuda-graph --flash-decode --bf16"
).split()


def git_blob_id(path: Path) -> str:
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@pytest.mark.parametrize("path", list(REFERENCE_BLOBS), ids=lambda p: p.name)
def test_the_fixtures_and_the_tag_catalogue_are_the_reference_files(path):
    assert git_blob_id(path) == REFERENCE_BLOBS[path]


# ---- the decoder's golden YAML -------------------------------------------------------------------


def test_the_golden_yaml_loads_unchanged_through_the_workers_reader():
    cfg = read_decoder_config(GOLDEN)
    assert (cfg.latent_dim, cfg.n_filters, cfg.rates, cfg.channels) == (128, 192, (8, 8, 8, 4), 2)
    assert (cfg.n_codebooks, cfg.codebook_size, cfg.hop, cfg.sample_rate, cfg.final_tanh) == (
        64,
        1024,
        2048,
        44100,
        False,
    )


def test_our_release_yaml_at_full_size_is_the_golden_file_byte_for_byte():
    assert release_yaml(FULL_SIZES).encode() == GOLDEN.read_bytes()


def _golden_with(tmp_path: Path, old: str, new: str) -> Path:
    text = GOLDEN.read_text()
    assert old in text
    out = tmp_path / "dac.yaml"
    out.write_text(text.replace(old, new))
    return out


@pytest.mark.parametrize("value", ["False", "True", "false", "0", "64", "n", "null"])
def test_q_dropout_is_read_as_the_reference_reads_it_only_while_training(tmp_path, value):
    cfg = read_decoder_config(_golden_with(tmp_path, "q_dropout: False", f"q_dropout: {value}"))
    assert cfg.n_codebooks == 64


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("  q_dropout: False", "", "missing the key 'quantizer.q_dropout'"),
        ("  decay: 0.99", "  decay: 0.99\n  q_drop: 3", "key 'quantizer.q_drop' is not an argument of the reference's"),
        ("  out_channel: 2", "  out_channel: 2\n  tanh: true", "key 'decoder.tanh' is not an argument"),
        ("  rates: [8, 8, 8, 4]\n", "", "missing the key 'decoder.rates'"),
        ("  decay: 0.99", "  decay: 0.99\n  codebook_dim: 8", "projected codebooks are not supported"),
    ],
)
def test_what_the_reference_refuses_is_refused_naming_the_key(tmp_path, old, new, message):
    path = _golden_with(tmp_path, old, new)
    with pytest.raises(ConfigError, match=message) as err:
        read_decoder_config(path)
    assert str(path) in str(err.value)


def test_training_only_keys_and_absent_encoder_defaults_are_accepted_as_the_reference_does(tmp_path):
    path = _golden_with(tmp_path, "  decay: 0.99", "  decay: fast\n  kmeans_init: false\n  epsilon: 1.0e-5")
    assert read_decoder_config(path).codebook_size == 1024
    text = GOLDEN.read_text().replace("  input_channel: 2\n  n_filters: 128\n  strides: [4, 8, 8, 8]\n", "")
    (tmp_path / "enc.yaml").write_text(text)
    assert read_decoder_config(tmp_path / "enc.yaml").latent_dim == 128


# ---- the tokenizer's config --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def release_tokenizer(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer")
    write_release_tokenizer(folder)
    return folder


def test_our_tokenizer_writer_emits_the_reference_config_files_byte_for_byte(release_tokenizer):
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        assert (release_tokenizer / name).read_bytes() == (TOKENIZER / name).read_bytes(), name


def test_the_reference_config_loads_through_the_workers_tokenizer_and_names_the_prompt_ids(release_tokenizer, tmp_path):
    folder = tmp_path / "Tokenizer"
    shutil.copytree(release_tokenizer, folder)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(TOKENIZER / name, folder / name)  # the reference's own files beside our tokenizer.json
    tok = load_tokenizer(folder)
    table = json.loads((TOKENIZER / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    assert len(table) == 256
    assert all(tok.token_id(entry["content"]) == int(i) for i, entry in table.items())
    assert (tok.token_id(BOS), tok.token_id(EOD)) == (128000, 128001)
    minutes = [tok.token_id(duration_token(m)) for m in range(16)]
    assert minutes == [128002, 128003, 128005, *range(128011, 128024)]  # not consecutive, as in Llama-3.1
    assert [tok.token_id(t) for t in ("<|eom_id|>", "<|eot_id|>", "<|python_tag|>")] == [128008, 128009, 128010]


# ---- the tag catalogue ------------------------------------------------------------------------------


def test_the_builtin_catalogue_is_served_as_the_reference_serves_its_tags_json():
    raw = json.loads(tag_catalogue.BUILTIN.read_text(encoding="utf-8"))
    assert tag_catalogue.load_catalogue(tag_catalogue.BUILTIN) == raw == tag_catalogue.TAGS
    assert list(raw) == ["genre_style", "vocal_instrument", "emotion_mood", "production_other"]
    assert [len(g["tags"]) for g in raw.values()] == [69, 56, 33, 39]


# ---- the launcher's flags -------------------------------------------------------------------------------


def test_every_flag_of_the_reference_launcher_gets_a_true_verdict():
    words = {}
    for flag in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        words[flag] = verdict(flag, 1, set())[0]
    for flag in ("tokenizer_type", "stream", "enable_cuda_graph", "flash_decode", "bf16"):
        words[flag] = verdict(flag, True, set())[0]
    for flag in ("norm_epsilon", "num_tokens_to_generate", "inference_max_seq_length"):
        words[flag] = verdict(flag, 1, set())[0]
    assert words == {
        "tensor_model_parallel_size": "not needed",
        "pipeline_model_parallel_size": "not needed",
        "tokenizer_type": "not needed",
        "stream": "not needed",
        "enable_cuda_graph": "not needed",
        "flash_decode": "not needed",
        "bf16": "not needed",
        "norm_epsilon": "applied",
        "num_tokens_to_generate": "applied",
        "inference_max_seq_length": "applied",
    }
    assert verdict("num_tokens_to_generate", 128, {"max_new_tokens"})[0] == "not needed"
    assert verdict("tensor_model_parallel_size", 2, set())[0] == "refused"
    assert verdict("fp16", True, set())[0] == "refused"
    assert verdict("model_provider", "mamba", set())[0] == "refused"
    # add_worker_args / add_common_inference_args of the reference worker
    for flag in ("child_once", "artifact_dir", "temperature", "top_k", "top_p", "prompts", "output_path"):
        assert verdict(flag, True, set())[0] == "not needed", flag
    assert verdict("max_batch_size", 2, set())[0] == "applied"
    assert verdict("some_flag_nobody_knows", 1, set())[0] == "ignored"


def _settings(monkeypatch, env: dict[str, str], megatron: str) -> WorkerSettings:
    for k in ("MAX_NEW_TOKENS", "MAX_BATCH", "MEGATRON_ARGS"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return load_settings(WorkerSettings, [], megatron_args=megatron)


def test_num_tokens_to_generate_sets_the_budget_and_an_explicit_max_new_tokens_wins(monkeypatch, caplog):
    with caplog.at_level(logging.INFO):
        s = apply_launcher_flags(_settings(monkeypatch, {}, "--num-tokens-to-generate 128 --max-batch-size 2"))
    assert (s.max_new_tokens, s.max_batch) == (128, 2)
    assert "backbone token budget: 128 new tokens (from the launcher flag --num-tokens-to-generate)" in caplog.text
    assert "launcher flag --num-tokens-to-generate 128: applied: sets MAX_NEW_TOKENS" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO):
        s = apply_launcher_flags(_settings(monkeypatch, {"MAX_NEW_TOKENS": "512"}, "--num-tokens-to-generate 128"))
    assert s.max_new_tokens == 512
    assert "backbone token budget: 512 new tokens (MAX_NEW_TOKENS set explicitly)" in caplog.text
    assert "MAX_NEW_TOKENS is set explicitly and wins" in caplog.text
    with pytest.raises(ConfigError, match="--fp16"):
        apply_launcher_flags(_settings(monkeypatch, {}, "--fp16"))
    with pytest.raises(ConfigError, match="--num-tokens-to-generate: must be an integer"):
        apply_launcher_flags(_settings(monkeypatch, {}, "--num-tokens-to-generate lots"))


def test_the_reference_launchers_command_line_with_128_tokens_gives_a_64_frame_track(release_dir, tmp_path):
    flags = [("128" if f == "23552" else f) for f in LAUNCHER_MEGATRON_ARGS]
    w = start_worker(
        tmp_path, "--runtime-mode", "keep_loaded", "--seed", "1283", *flags, env={"CHECKPOINTS_DIR": str(release_dir)}
    )
    try:
        w.wait_healthy(timeout=300)
        body = {"lyrics": "[verse]\nhello world", "tags": "Pop, Piano", "duration": 5 / 60, "seed_override": 5}
        out = httpx.post(w.url + "/generate", json=body, timeout=300, verify=TLS).json()
        assert out["status"] == "ok", out
        meta = httpx.get(f"{w.url}/download/{out['json_filename']}", timeout=30, verify=TLS).json()
        assert meta["tokens"]["frames"] == 64
        assert meta["tokens"]["backbone_new"] == 128
        wav = httpx.get(f"{w.url}/download/{out['wav_filename']}", timeout=30, verify=TLS).content
        audio, sr = sf.read(io.BytesIO(wav))
        assert (sr, audio.shape) == (44100, (64 * 2048, 2))
        assert httpx.get(w.url + "/config", timeout=10, verify=TLS).json()["max_new_tokens"] == 128
        log = w.log_tail(200_000)
        assert "backbone token budget: 128 new tokens (from the launcher flag --num-tokens-to-generate)" in log
        assert "launcher flag --flash-decode True: not needed:" in log
        assert "unrecognized" not in log
    finally:
        w.stop()
