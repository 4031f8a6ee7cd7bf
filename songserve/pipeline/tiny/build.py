"""Build the tiny checkpoint set of the real architecture, deterministically (CLI: ``tiny/__main__.py``).

Same layout and on-disk formats a real set has, with small widths and depths (the real frame rate,
21.53 frames/s, and 44.1 kHz stereo are kept):

    tokenizer/tokenizer.model        sentencepiece, trained on a built-in lyric corpus
    backbone/                        Megatron-LM torch_dist checkpoint + model_config.json
    superres/                        the same, vocabulary T + 64·1024
    decoder/config.yaml, model.pth   YAML + checkpoint with ``generator.``-prefixed, weight-normed keys
    adapters/                        seeded LoRA adapters for both models (``tiny/adapters.py``)

``--layout release`` writes the layout and formats of the published release at tiny widths
(``RELEASE_LAYOUT`` below): Megatron-LM torch_dist checkpoints with the architecture in the saved
``args`` (no model_config.json), Transformer-Engine names, per-layer keys, split SwiGLU, padded
vocabulary rows, and the release's architecture family (RoPE base 500000, RMSNorm ε 1e-6, SwiGLU,
grouped-query attention, dense-layer biases, untied output) with the Llama-3 text vocabulary
(128,256: backbone vocab 130,304 padded to 130,432, superres 193,792 padded to 193,920).

The weights are seeded random: the set is untrained, so it sounds like noise of the right shape
and length. The set is written to a temporary folder and renamed into place, under a file lock,
so concurrent workers build it once.
"""

from __future__ import annotations

import fcntl
import json
import logging
import shutil
import time
from pathlib import Path

import torch

from songserve.pipeline.engine.arch import GPTArch
from songserve.pipeline.numbers import BACKBONE_LEVELS, CODEBOOK, LEVELS, SUPERRES_LEVELS
from songserve.pipeline.stages.codec import DecoderConfig
from songserve.pipeline.tiny.manifest import RELEASE_VERSION, TINY_VERSION, is_current

log = logging.getLogger(__name__)

SEED = 1283
TEXT_VOCAB = 1024  # the tiny tokenizer's pieces


def tiny_arch(kind: str, text_vocab: int) -> GPTArch:
    if kind == "backbone":
        return GPTArch(kind, 2, 64, 4, 256, text_vocab, text_vocab + BACKBONE_LEVELS * CODEBOOK, 27648, 1024)
    return GPTArch(kind, 2, 64, 4, 256, text_vocab, text_vocab + SUPERRES_LEVELS * CODEBOOK, 16384, 1024)


def tiny_decoder_config() -> DecoderConfig:
    return DecoderConfig(latent_dim=32, n_filters=4, rates=(8, 8, 8, 4), channels=2)


def _build_into(tmp: Path) -> None:
    import yaml

    from songserve.pipeline.checkpoints.megatron_env import init_megatron
    from songserve.pipeline.engine.gpt import build_model
    from songserve.pipeline.stages.codec import AudioDecoder, weight_norm_state
    from songserve.pipeline.stages.tokenizer import SentencePieceTokenizer, train_sentencepiece
    from songserve.pipeline.tiny.decoder_release import ReleaseDecoderSizes, encoder_state
    from songserve.pipeline.tiny.gpt_write import save_checkpoint

    cpu = torch.device("cpu")
    init_megatron(cpu, 0, seed=SEED)
    (tmp / "tokenizer").mkdir(parents=True)
    proto = train_sentencepiece(TEXT_VOCAB)
    (tmp / "tokenizer" / "tokenizer.model").write_bytes(proto)
    text_vocab = SentencePieceTokenizer(proto, "tiny").vocab_size
    log.info("tokenizer: %d pieces", text_vocab)

    for i, kind in enumerate(("backbone", "superres")):
        torch.manual_seed(SEED + i)
        arch = tiny_arch(kind, text_vocab)
        model = build_model(arch, cpu, torch.float32)
        save_checkpoint(tmp / kind, arch, model)
        log.info("%s: %d parameters", kind, sum(p.numel() for p in model.parameters()))

    from songserve.pipeline.tiny.adapters import write_tiny_adapters

    write_tiny_adapters(tmp / "adapters", {k: tiny_arch(k, text_vocab) for k in ("backbone", "superres")})

    torch.manual_seed(SEED + 2)
    cfg = tiny_decoder_config()
    decoder = AudioDecoder(cfg)
    with torch.no_grad():  # DAC-like scale: unit-ish codebooks, Snake alphas of 1
        for q in decoder.quantizer.quantizers:
            q.codebook.weight.normal_(0.0, 0.3)  # type: ignore[union-attr,operator]
    (tmp / "decoder").mkdir()
    (tmp / "decoder" / "config.yaml").write_text(yaml.safe_dump(cfg.to_yaml_dict(), sort_keys=False))
    state = {f"generator.{k}": v for k, v in weight_norm_state(decoder.state_dict()).items()}
    sizes = ReleaseDecoderSizes(
        encoder_filters=cfg.n_filters // 2, strides=tuple(reversed(cfg.rates)), d_latent=cfg.latent_dim
    )
    state.update(encoder_state(sizes, torch.Generator().manual_seed(SEED + 3)))  # the codec's encoder (uploads)
    torch.save({"state_dict": state}, tmp / "decoder" / "model.pth")
    (tmp / "MANIFEST.json").write_text(
        json.dumps({"tiny_version": TINY_VERSION, "seed": SEED, "untrained": True, "built_at": time.time()}) + "\n"
    )


RELEASE_LAYOUT = {
    "backbone": "checkpoints/backbone",
    "superres": "checkpoints/superresolution",
    "decoder_checkpoint": "checkpoints/dac_rvq_2490000.ckpt",
    "decoder_config": "models/Decoder/dac_rvq_1024_64_golden.yaml",
    "tokenizer": "models/Tokenizer",
}


def release_arch(kind: str, text_vocab: int) -> GPTArch:
    """The release's architecture family at tiny widths (2 layers, hidden 32, 4 heads in 2 groups)."""
    vocab = text_vocab + LEVELS[kind] * CODEBOOK
    padded = -(-(vocab + 1) // 128) * 128  # NullTokenizer's extra id, padded to a multiple of 128
    return GPTArch(
        kind,
        2,
        32,
        4,
        96,
        text_vocab,
        vocab,
        4096,
        2048,
        num_query_groups=2,
        normalization="RMSNorm",
        norm_epsilon=1e-6,
        position_embedding_type="rope",
        rotary_base=500000,
        gated_linear_unit=True,
        add_bias_linear=True,
        share_embeddings_and_output_weights=False,
        padded_vocab_size=padded,
    )


def _build_release_into(tmp: Path) -> None:
    from songserve.pipeline.checkpoints.megatron_env import init_megatron
    from songserve.pipeline.engine.gpt import build_model
    from songserve.pipeline.tiny.decoder_release import write_release_decoder
    from songserve.pipeline.tiny.gpt_write import release_args, save_release_checkpoint
    from songserve.pipeline.tiny.tokenizer_release import write_release_tokenizer

    cpu = torch.device("cpu")
    init_megatron(cpu, 0, seed=SEED)
    text_vocab = write_release_tokenizer(tmp / RELEASE_LAYOUT["tokenizer"])
    log.info("tokenizer: %d ids", text_vocab)
    for i, kind in enumerate(("backbone", "superres")):
        torch.manual_seed(SEED + i)
        arch = release_arch(kind, text_vocab)
        model = build_model(arch, cpu, torch.float32)
        save_release_checkpoint(tmp / RELEASE_LAYOUT[kind], model, release_args(arch))
        log.info("%s: %d parameters", kind, sum(p.numel() for p in model.parameters()))
    torch.manual_seed(SEED + 2)
    write_release_decoder(tmp / RELEASE_LAYOUT["decoder_config"], tmp / RELEASE_LAYOUT["decoder_checkpoint"])
    (tmp / "MANIFEST.json").write_text(
        json.dumps({"release_version": RELEASE_VERSION, "seed": SEED, "untrained": True, "built_at": time.time()})
        + "\n"
    )


def ensure_release_set(out: Path, force: bool = False) -> Path:
    """Build the release-shaped tiny set at ``out`` unless a current one is there."""
    return ensure_tiny_set(out, force, layout="release")


def ensure_tiny_set(out: Path, force: bool = False, layout: str = "default") -> Path:
    """Build the set at ``out`` unless a current one is there; safe to call from many processes."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_current(out, layout) and not force:
            return out
        tmp = out.parent / f".{out.name}.building"
        shutil.rmtree(tmp, ignore_errors=True)
        t0 = time.perf_counter()
        log.info("building the tiny checkpoint set in %s", out)
        (_build_release_into if layout == "release" else _build_into)(tmp)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
        log.info("tiny checkpoint set ready in %.1f s", time.perf_counter() - t0)
    return out
