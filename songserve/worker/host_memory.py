"""A model worker's host memory: two allocators whose defaults make a long-running worker grow.

Measured on a tiny-set worker (``bench/p17_worker_memory.py``): with both defaults, two-take jobs
with live audio grew the worker from 0.6 GB to 1.3 GB in 20 jobs and went on rising; with the
two settings below the same series stays within a few MB of its first job. Neither holder is
Python's: no object, tensor or thread outlives its job.

1. **oneDNN's primitive cache.** On the CPU every convolution (the codec's decoder and encoder)
   runs a oneDNN kernel built for its exact input length, and oneDNN keeps the last 1,024 it built
   (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``), each with its buffers: ~0.7 MB apiece on the tiny set.
   A whole song decodes in chunks of a few lengths, but live audio decodes windows of whatever
   length is ready, and songs and retakes end at any frame: a worker fills the cache over hours.
   Building a kernel costs less than the convolution it runs (bench P17 times a song both ways),
   so the cache is kept small. oneDNN reads the variable when it first builds a kernel, which is
   after this module runs: the worker sets it before its first model call.
2. **glibc's sliding mmap threshold.** glibc serves large blocks with ``mmap`` (returned to the
   system at ``free``) but raises that threshold, up to 32 MiB, each time such a block is freed:
   after the first big tensors, tensors of a few MB come from the heap and its per-thread arenas,
   where the holes between them stay resident. A fixed threshold (``mallopt``, which also stops
   glibc from moving it) sends them back to ``mmap`` for good.

On CUDA the device's allocator holds the large tensors and neither applies much; both are set
anyway (the encoder and the live audio's host side use the CPU).
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
ONEDNN_CACHE_VARIABLE = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"


def apply(onednn_primitives: int, mmap_threshold_kb: int) -> str:
    """Bound oneDNN's cache and fix glibc's mmap threshold for this process; says what was set."""
    os.environ[ONEDNN_CACHE_VARIABLE] = str(onednn_primitives)
    said = [f"oneDNN keeps {onednn_primitives} CPU kernels"]
    if mmap_threshold_kb > 0:
        try:
            ok = ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, mmap_threshold_kb * 1024)
        except (OSError, AttributeError):  # not glibc: its allocator has no such threshold
            ok = 0
        if ok:
            said.append(f"host blocks of {mmap_threshold_kb} KiB and more are mapped")
        else:
            log.warning("MALLOC_MMAP_THRESHOLD_KB=%d was not applied: this C library has no mallopt", mmap_threshold_kb)
    return "; ".join(said)
