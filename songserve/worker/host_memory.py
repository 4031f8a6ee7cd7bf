"""A model worker's host memory: what made a long-running worker grow, and what keeps it flat.

Measured on a tiny-set worker (``bench/p17_worker_memory.py``): two-take jobs with live audio grew
the worker from 0.6 GB to 1.3 GB in 20 jobs and it went on rising; with what is done here the same
series stays within a few MB of its first job, at no cost in time that P17 can tell from noise.
Neither holder was Python's: no object, tensor or thread outlived its job.

1. **oneDNN's primitive cache.** On the CPU every convolution (the codec's decoder and encoder)
   runs a oneDNN kernel built for its exact input length, and oneDNN keeps the last 1,024 it built,
   each with its buffers (~0.7 MB apiece on the tiny set). A whole song decodes in chunks of a few
   lengths, but live audio decodes windows of whatever length is ready, and songs and retakes end
   at any frame: a worker filled the cache over hours. ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` (the
   variable oneDNN itself reads, when it first builds a kernel: after this module sets it) keeps
   64, room for the decoder's steady chunks, so a song decodes as fast as with 1,024.
2. **glibc's heap keeps what is freed.** Tensors of a few MB (glibc maps only blocks above a
   threshold that rises to 32 MiB after the first large ones are freed) come from the heap and its
   arenas, and freed pages between live blocks stay resident. ``trim`` gives them back once per
   run (``malloc_trim``: a few ms after each batch and encoding, on the model thread). A fixed, low
   mmap threshold did the same but mapped every large tensor anew: a batch 30 % slower.

On CUDA the device's allocator holds the large tensors; both still apply to the host side.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)
ONEDNN_CACHE_VARIABLE = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: no malloc_trim, and a heap of its own rules
        return None


_LIBC = _libc()


def apply(onednn_primitives: int, trim_after_runs: bool) -> str:
    """Bound oneDNN's kernel cache for this process; says what was set."""
    os.environ[ONEDNN_CACHE_VARIABLE] = str(onednn_primitives)
    trims = trim_after_runs and _LIBC is not None and hasattr(_LIBC, "malloc_trim")
    if trim_after_runs and not trims:
        log.warning("MALLOC_TRIM is on, but this C library has no malloc_trim: freed heap memory stays resident")
    return f"oneDNN keeps {onednn_primitives} CPU kernels; freed heap memory {'given back after each run' if trims else 'kept'}"


def trim() -> None:
    """Return the heap's free pages to the system (glibc ``malloc_trim``); nothing elsewhere."""
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)
