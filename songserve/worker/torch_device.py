"""The model pipeline's device as the runtime sees it: torch's threads, inference mode, CUDA memory.

The only worker module that imports torch. ``worker/main.py`` imports it on the model path only,
so a worker started with ``--pipeline test`` never loads torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import torch

from songserve.errors import ConfigError
from songserve.worker import host_memory


def pick_device(choice: str) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda was asked for, but CUDA is not available.")
        return torch.device("cuda", 0)  # the launcher's CUDA_VISIBLE_DEVICES picks the GPU
    return torch.device("cpu")


class TorchDevice:
    """A ``torch.device`` and the CPU threads torch may use on the model thread."""

    def __init__(self, device: torch.device, threads: int, trim: bool = True) -> None:
        self.device = device
        self.threads = threads
        self.trim = trim  # MALLOC_TRIM: the heap's freed pages back to the system after each run

    @property
    def name(self) -> str:
        return str(self.device)

    def prepare_thread(self) -> None:
        torch.set_num_threads(self.threads)

    def inference(self) -> AbstractContextManager[None]:
        return self._run()

    @contextmanager
    def _run(self) -> Iterator[None]:
        """One run under inference mode; then what it freed goes back to the system (``host_memory``)."""
        try:
            with torch.inference_mode():
                yield
        finally:
            if self.trim:
                host_memory.trim()

    def memory_mb(self) -> dict[str, float]:
        if self.device.type != "cuda":
            return {}
        return {"cuda_allocated_mb": round(torch.cuda.memory_allocated() / 2**20, 1)}

    def is_out_of_memory(self, exc: BaseException) -> bool:
        return isinstance(exc, torch.OutOfMemoryError)
