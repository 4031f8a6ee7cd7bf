"""Where the model thread computes, as the runtime sees it: a name for the reports, and torch's knobs.

The runtime never imports torch: the test tone needs none, and each tone worker the dispatcher's
tests start would otherwise pay for loading it. ``TorchDevice`` (``worker/torch_device.py``) is made
on the model path only; the tone pipeline runs with ``ToneDevice``.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Protocol


class Device(Protocol):
    """What the runtime asks of the device its pipeline computes on."""

    @property
    def name(self) -> str:
        """``cpu`` or ``cuda:0``, as ``/health``, ``/config`` and ``/ready`` show it."""
        ...

    def prepare_thread(self) -> None:
        """Once, on the model thread, before the pipeline loads."""
        ...

    def inference(self) -> AbstractContextManager[None]:
        """Entered around every run on the model thread."""
        ...

    def memory_mb(self) -> dict[str, float]:
        """``/health``'s device memory fields (``cuda_allocated_mb`` on CUDA; none on the CPU)."""
        ...

    def is_out_of_memory(self, exc: BaseException) -> bool:
        """Whether ``exc`` is the framework's own out-of-memory error (a plain ``MemoryError`` is known anyway)."""
        ...


class ToneDevice:
    """The test tone's: numpy on the CPU, nothing to set up."""

    name = "cpu"

    def prepare_thread(self) -> None:
        pass

    def inference(self) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def memory_mb(self) -> dict[str, float]:
        return {}

    def is_out_of_memory(self, exc: BaseException) -> bool:
        return False
