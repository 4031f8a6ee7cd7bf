"""``DecodeModel.step`` written over the Triton kernels: the ``fused`` decode mode (``decode_step.py``).

Per layer: the qkv product, ``rope_write`` (RoPE on q and k, k and v written into the cache at the
position), split-KV attention (two kernels), the output projection, ``add_rmsnorm`` (its bias, the
residual and the MLP's norm), ``swiglu`` (the MLP's first matrix, SiLU and the product in one pass),
the second matrix, ``add_rmsnorm`` again (into the next layer's norm, or the final one): 9 launches
where the eager step has ~15 kernels. The matrix products stay torch's (cuBLAS reads the weights at
the bandwidth the step is bound by). ``sample`` is the backbone's projection and draw in one kernel
pair (``kernels.project_sample``).

A batch with adapters (``lora.py``) adds each row's delta with torch's batched products after
the qkv, output and second MLP products (the bias added first, as the eager step does), and runs
the first MLP product and SwiGLU unfused (the delta goes before the activation); under CUDA graphs
these are captured like the rest. No Triton kernel of its own for the delta (yet).

What the kernels cover is the release's family: RMSNorm, SwiGLU (SiLU), RoPE or learned positions;
any other model is refused at set-up (``ValueError``: the decode step stays eager, one log line).
Same function as the eager step: every mode draws the eager tokens (tests/model/test_decode_modes.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from songserve.pipeline.engine import kernels as K
from songserve.pipeline.engine.kernels_attention import decode_attention
from songserve.pipeline.engine.lora import Picked, RowLoRA, delta
from songserve.pipeline.engine.transformer import DecodeModel, LayerWeights
from songserve.pipeline.numbers import CODEBOOK


def unsupported(dm: DecodeModel) -> str | None:
    """Why the fused step cannot run this model, or None."""
    s = dm.spec
    if s.normalization != "RMSNorm":
        return f"the fused step needs RMSNorm (this model: {s.normalization})"
    if not s.gated or dm.activation is not F.silu:
        return "the fused step needs SwiGLU (a gated MLP with SiLU)"
    return None


class FusedStep:
    """Called as ``DecodeModel.step``; ``sample`` as the backbone's projection + ``sample_rows``."""

    def __init__(self, dm: DecodeModel) -> None:
        why = unsupported(dm)
        if dm.device.type != "cuda" and not K.INTERPRETED:
            why = "the fused step on the CPU runs under Triton's interpreter: start with TRITON_INTERPRET=1"
        if why:
            raise ValueError(why)
        self.dm = dm

    def _w(self, w: torch.Tensor) -> torch.Tensor:
        return w + 1 if self.dm.spec.zero_centered_gamma else w

    def _next_norm(self, i: int) -> torch.Tensor:
        layers = self.dm.layers
        return self._w(layers[i + 1].ln1_w if i + 1 < len(layers) else self.dm.final_w)

    def __call__(
        self,
        tokens: torch.Tensor,
        pos: torch.Tensor,
        k_cache: list[torch.Tensor],
        v_cache: list[torch.Tensor],
        kv_len: int,
        masked: bool,  # the kernel masks keys past ``pos`` itself
        lora: RowLoRA | None = None,
    ) -> torch.Tensor:
        dm, s = self.dm, self.dm.spec
        picked = dm.pick_lora(lora)
        x = F.embedding(tokens, dm.word)
        if dm.pos_table is not None:
            x = x + dm.pos_table.index_select(0, pos)
        if s.fp32_residual:
            x = x.float()
        x, y = K.add_rmsnorm(x, None, None, self._w(dm.layers[0].ln1_w), s.eps)
        for i, lw in enumerate(dm.layers):
            x, y = self._layer(i, lw, x, y, pos, k_cache[i], v_cache[i], kv_len, picked)
        return y

    def _layer(
        self,
        i: int,
        lw: LayerWeights,
        x: torch.Tensor,
        y: torch.Tensor,
        pos: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        kv_len: int,
        lora: Picked | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dm, s = self.dm, self.dm.spec
        mixed = F.linear(y, lw.qkv_w, lw.qkv_b)
        if lora is not None:
            mixed = mixed + _delta(lora, "linear_qkv", i, y)
        q = K.rope_write(mixed, dm._rope_cos, dm._rope_sin, pos, k_cache, v_cache, s.heads, s.rotary_interleaved)
        o = decode_attention(q, k_cache, v_cache, pos, kv_len, s.scale)
        if lora is None:
            x, y = K.add_rmsnorm(x, F.linear(o, lw.proj_w), lw.proj_b, self._w(lw.ln2_w), s.eps)
            h = K.swiglu(y, lw.fc1_w, lw.fc1_b)
            return K.add_rmsnorm(x, F.linear(h, lw.fc2_w), lw.fc2_b, self._next_norm(i), s.eps)
        out = _biased(F.linear(o, lw.proj_w), lw.proj_b) + _delta(lora, "linear_proj", i, o)
        x, y = K.add_rmsnorm(x, out, None, self._w(lw.ln2_w), s.eps)
        gate, up = (F.linear(y, lw.fc1_w, lw.fc1_b) + _delta(lora, "linear_fc1", i, y)).chunk(2, dim=-1)
        h = F.silu(gate) * up
        out = _biased(F.linear(h, lw.fc2_w), lw.fc2_b) + _delta(lora, "linear_fc2", i, h)
        return K.add_rmsnorm(x, out, None, self._next_norm(i), s.eps)

    def sample(
        self,
        hidden: torch.Tensor,
        start: int,
        eod: int | None,
        top_k: int,
        generators: list[torch.Generator],
        temperature: float,
    ) -> torch.Tensor:
        """The codebook window at ``start`` (plus the end-of-document row ``eod``) → one code per row."""
        return K.project_sample(hidden, self.dm.output_weight, start, eod, top_k, generators, temperature, CODEBOOK)


def _biased(out: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return out if b is None else out + b


def _delta(lora: Picked, name: str, i: int, x: torch.Tensor) -> torch.Tensor:
    """x (B, in) → each row's adapter delta (B, out) for target ``name`` of layer ``i``."""
    return delta(lora, name, i, x.unsqueeze(1)).squeeze(1).to(x.dtype)
