"""Device checks for one GPU (run by bench/gpu_check.sh): decode tokens/s eager vs CUDA graphs at
batch 1 and 2, and one 30 s track at the release's full-size shapes with random weights.

Release shapes (shared/docs/model.md): 24 layers, hidden 2,048, 32 heads in 8 query groups, SwiGLU
ffn 5,632, RMSNorm ε 1e-6, RoPE base 500,000, qkv biases, untied output, bf16; backbone vocabulary
130,304 (context 25,600), superres 193,792; the full DAC decoder. One summary line per figure.
"""

from __future__ import annotations

import sys
import time

import torch

from bench.common import args, report

T_TEXT = 128256


def release_gpt(vocab: int, context: int, device: torch.device, kind: str):
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from songserve.pipeline.attention import SdpaDotProductAttention
    from songserve.pipeline.gpt import AcousticGPT, GPTArch

    config = TransformerConfig(
        num_layers=24,
        hidden_size=2048,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=5632,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=True,
        add_qkv_bias=True,
        params_dtype=torch.bfloat16,
        bf16=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        cuda_graph_scope=[],
    )
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = SdpaDotProductAttention
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab,
        max_sequence_length=context,
        position_embedding_type="rope",
        rotary_base=500000,
        share_embeddings_and_output_weights=False,
    )
    model = model.to(device=device, dtype=torch.bfloat16).eval()
    arch = GPTArch(
        kind=kind,
        num_layers=24,
        hidden_size=2048,
        num_attention_heads=32,
        ffn_hidden_size=5632,
        text_vocab_size=T_TEXT,
        vocab_size=vocab,
        max_sequence_length=context,
        max_prompt_length=4096,
        num_query_groups=8,
    )  # only the vocabulary layout and limits are read from it: the step reads megatron's config
    return AcousticGPT(arch, model)


def tokens_per_s(bb, batch: int, tokens: int) -> float:
    from songserve.pipeline.backbone import LengthPlan, Take
    from songserve.pipeline.context import TaskContext

    takes = [Take(torch.Generator(device="cuda").manual_seed(i), TaskContext(f"t{i}")) for i in range(batch)]
    plan = LengthPlan(tokens // 2, tokens // 2, tokens)
    with torch.inference_mode():
        bb.generate_batch(list(range(2, 258)), plan, takes, top_k=80, temperature=1.0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        takes = [Take(torch.Generator(device="cuda").manual_seed(i), TaskContext(f"t{i}")) for i in range(batch)]
        bb.generate_batch(list(range(2, 258)), plan, takes, top_k=80, temperature=1.0)
        torch.cuda.synchronize()
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    from songserve.pipeline.backbone import Backbone, LengthPlan, Take
    from songserve.pipeline.context import TaskContext
    from songserve.pipeline.decode import GraphedStep
    from songserve.pipeline.decoder import AudioDecoder, DecoderConfig
    from songserve.pipeline.megatron_env import init_megatron
    from songserve.pipeline.superres import SuperRes

    a = args(__doc__, tokens=512, seconds=30.0)
    if not torch.cuda.is_available():
        report("GPU", "no CUDA device: nothing measured")
        sys.exit(0)
    dev = torch.device("cuda", 0)
    init_megatron(dev, 0, seed=0)
    torch.backends.cuda.matmul.allow_tf32 = True

    t0 = time.perf_counter()
    bb = Backbone(release_gpt(130304, 25600, dev, "backbone"), eod_id=128001)
    report(
        "GPU-build",
        f"release backbone built in {time.perf_counter() - t0:.0f}s, {torch.cuda.memory_allocated() / 2**30:.1f} GiB",
    )
    bb.bucket = 1024
    eager = {b: tokens_per_s(bb, b, a.tokens) for b in (1, 2)}
    t0 = time.perf_counter()
    step = GraphedStep(bb.dm, 25600)
    step.warm([1, 2], [1024])
    bb.compiled = step
    warm = time.perf_counter() - t0
    graphs = {b: tokens_per_s(bb, b, a.tokens) for b in (1, 2)}
    report(
        "GPU-decode",
        f"release 24x2048 bf16, {a.tokens} tokens/take: eager b1 {eager[1]:.0f}, b2 {eager[2]:.0f} tok/s/batch; "
        f"graphs b1 {graphs[1]:.0f}, b2 {graphs[2]:.0f}; graphs/eager b1 {graphs[1] / eager[1]:.2f}x; "
        f"2 takes cost {graphs[1] / graphs[2]:.2f}x one take (target <= 1.2x); capture {warm:.1f}s; {step.describe()['fallback']}",
    )

    frames = int(a.seconds * 44100 / 2048)
    prompt = list(range(2, 202))
    ctx = TaskContext("track")
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.inference_mode():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        r = bb.generate_batch(
            prompt, LengthPlan(frames, frames, 2 * frames), [Take(gen, ctx)], top_k=80, temperature=1.0
        )
        torch.cuda.synchronize()
        t_bb = time.perf_counter() - t0
        coarse = r[0].codes
        sr = SuperRes(release_gpt(193792, 8192 + 2048, dev, "superres"))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        codes = sr.generate(prompt, coarse, top_k=10, generator=gen, ctx=ctx)
        torch.cuda.synchronize()
        t_sr = time.perf_counter() - t0
        decoder = AudioDecoder(DecoderConfig()).to(dev).eval()
        t0 = time.perf_counter()
        wave = decoder.decode(codes.unsqueeze(0).to(dev), 256, 16)
        torch.cuda.synchronize()
        t_dec = time.perf_counter() - t0
    total = t_bb + t_sr + t_dec
    report(
        "GPU-track",
        f"{a.seconds:.0f}s track at release shapes (random weights): backbone {t_bb:.1f}s ({2 * frames / t_bb:.0f} tok/s), "
        f"superres {t_sr:.1f}s, decoder {t_dec:.1f}s, total {total:.1f}s = {a.seconds / total:.1f}x real time; "
        f"audio {tuple(wave.shape)}, peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB",
    )


if __name__ == "__main__":
    main()
