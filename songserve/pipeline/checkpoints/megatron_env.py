"""Megatron-core's process state for one worker, on CUDA or on the CPU.

megatron-core assumes CUDA in six places (shared/docs/megatron-cpu.md); on the CPU this module
works round the ones that start-up and checkpoint I/O hit:
  1. the model-parallel RNG tracker asserts CUDA: use the inference (no-op) tracker, seed torch;
  2. the global memory buffer allocates on the current CUDA device: install a CPU one;
  4. RoPE's ``get_emb`` moves ``inv_freq`` to ``torch.cuda.current_device()`` on first use: on a
     machine without CUDA it stays where it is (prefill, KV-cached steps and non-causal passes);
  6. ``dist_checkpointing.save`` synchronises CUDA and makes CUDA tensors: redirect both.
The other two (default causal mask, the KV-cache allocation) are handled where the model is
driven, in ``engine/oracle.py`` (the tests' forward through megatron).
"""

from __future__ import annotations

import contextlib
import logging
import operator
from collections.abc import Iterator, Sequence
from functools import reduce

import torch

log = logging.getLogger(__name__)


class _CpuMemoryBuffer:
    """Same contract as megatron's ``GlobalMemoryBuffer.get_tensor``, allocating on the CPU."""

    def __init__(self) -> None:
        self.buffer: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get_tensor(
        self, tensor_shape: Sequence[int], dtype: torch.dtype, name: str, mem_alloc_context: object = None
    ) -> torch.Tensor:
        n = reduce(operator.mul, tensor_shape, 1)
        buf = self.buffer.get((name, dtype))
        if buf is None or buf.numel() < n:
            buf = self.buffer[(name, dtype)] = torch.empty(n, dtype=dtype)
        return buf[:n].view(*tensor_shape)


def init_megatron(device: torch.device, master_port: int = 0, seed: int = 0, master_addr: str = "127.0.0.1") -> None:
    """Start a world of one (gloo on CPU, nccl on CUDA) and megatron's parallel state; idempotent.

    ``master_port`` 0 (tests, tools, workers by default) = no port: an in-process store; a port
    (MASTER_PORT) = a TCP store on ``master_addr`` only (process_group.py says why).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from songserve.pipeline.checkpoints.process_group import start_world_of_one

    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        where = start_world_of_one(backend, master_addr, master_port)
        log.debug("process group: %s, a world of one on %s", backend, where)  # nothing to act on
    if not parallel_state.model_parallel_is_initialized():
        # no gloo twins of the data-parallel groups: only training's optimizer uses them
        parallel_state.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)
        parallel_state._GLOBAL_MEMORY_BUFFER = _CpuMemoryBuffer()
        _rope_stays_on_cpu()
    torch.manual_seed(seed)


def _rope_stays_on_cpu() -> None:
    """Replace ``RotaryEmbedding.get_emb`` by the same computation without the move to CUDA (4.)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    if getattr(RotaryEmbedding.get_emb, "songserve_cpu", False):
        return

    def get_emb(self: RotaryEmbedding, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if not self.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        return emb[:, None, None, :]

    get_emb.songserve_cpu = True  # type: ignore[attr-defined]
    RotaryEmbedding.get_emb = get_emb


@contextlib.contextmanager
def cpu_checkpoint_io() -> Iterator[None]:
    """Let ``dist_checkpointing.save`` run without CUDA (6.): no-op sync, CPU 'current device'."""
    if torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.synchronize, torch.cuda.current_device
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = saved
