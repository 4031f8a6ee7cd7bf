"""``python backend_worker.py``: validate settings and checkpoints, then serve."""

from __future__ import annotations

import logging
import os
import shlex
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from songserve.errors import ConfigError
from songserve.process.logs import level_from_env, setup_logging
from songserve.process.settings import load_settings, log_non_default
from songserve.worker.launcher_flags import apply_launcher_flags
from songserve.worker.settings import WorkerSettings

if TYPE_CHECKING:
    from songserve.worker.runtime import WorkerRuntime

log = logging.getLogger("songserve.worker")


def build_runtime(s: WorkerSettings) -> WorkerRuntime:
    """Resolve the device and the checkpoint set (fails fast with one line), make the runtime.

    The test tone is numpy on the CPU: its path imports neither torch nor megatron (they take
    longer to import than the tone worker takes to start), so it picks no torch device.
    """
    from songserve.worker.runtime import WorkerRuntime

    if s.pipeline == "test":
        from songserve.pipeline.testing.tone import TonePipeline
        from songserve.worker.device import ToneDevice

        log.info("test pipeline: a tone, computed on the CPU")
        return WorkerRuntime(s, TonePipeline(s, max_batch=s.max_batch), ToneDevice())
    from songserve.worker import host_memory

    log.info("host memory: %s", host_memory.apply(s.onednn_primitive_cache_capacity, s.malloc_trim))
    import torch

    from songserve.pipeline.checkpoints.layout import resolve
    from songserve.pipeline.checkpoints.megatron_env import init_megatron
    from songserve.pipeline.pipeline import ModelPipeline
    from songserve.worker.torch_device import TorchDevice, pick_device

    torch.set_num_threads(s.torch_threads)
    device = pick_device(s.device)
    if device.type == "cpu":
        log.info("CUDA is not available or not asked for: running on the CPU")
    ckpt = resolve(s)
    init_megatron(device, s.master_port, s.seed, s.master_addr)
    return WorkerRuntime(s, ModelPipeline(s, ckpt, device), TorchDevice(device, s.torch_threads, s.malloc_trim))


def split_megatron_flags(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """The worker's own flags, and the Megatron-LM flags the reference launcher appends after them.

    ``run_backend.sh`` starts each worker as ``--worker-port P --runtime-mode M --seed S`` followed
    by Megatron flags (``--tensor-model-parallel-size 1 … --bf16``); those become overrides of the
    checkpoint's saved args (after ``MEGATRON_ARGS``), not "unrecognized arguments".
    """
    own = {"--" + name.replace("_", "-") for name in WorkerSettings.model_fields} | {"-h", "--help"}
    worker: list[str] = []
    megatron: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        dest = worker if tok.split("=", 1)[0] in own else megatron
        dest.append(tok)
        takes_value = "=" not in tok and i + 1 < len(argv) and not argv[i + 1].startswith("--")
        if takes_value:
            dest.append(argv[i + 1])
            i += 1
        i += 1
    return worker, megatron


def main(argv: Sequence[str] | None = None) -> int:
    import uvicorn

    setup_logging(f"worker[{os.environ.get('WORKER_INDEX', '-')}]", level_from_env())
    try:
        own, megatron = split_megatron_flags(sys.argv[1:] if argv is None else argv)
        s = load_settings(WorkerSettings, own)
        if megatron:
            s = s.model_copy(update={"megatron_args": f"{s.megatron_args} {shlex.join(megatron)}".strip()})
            log.info("Megatron flags from the command line: %s", shlex.join(megatron))
        s = apply_launcher_flags(s)
        log_non_default(s)
        runtime = build_runtime(s)
    except ConfigError as exc:
        print(f"worker: {exc}", file=sys.stderr)
        return 2

    from songserve.http.serving import GracefulServer, header_timeout_protocol
    from songserve.worker.app import create_app

    server: uvicorn.Server | None = None
    failed: list[str] = []

    def on_load_failure(exc: Exception) -> None:
        line = str(exc) if isinstance(exc, ConfigError) else f"loading the models failed: {exc}"
        log.error("%s", line)
        print(f"worker: {line}", file=sys.stderr)
        failed.append(line)
        if server is not None:
            server.should_exit = True

    app = create_app(runtime, on_load_failure)
    config = uvicorn.Config(
        app, host=s.host, port=s.worker_port, log_level="warning", http=header_timeout_protocol(s.header_timeout_sec)
    )
    server = GracefulServer(config, drain=lambda: runtime.drain(s.drain_timeout_sec))
    server.run()
    code = 2 if failed else 0
    if runtime.model_thread_busy:  # a hung model thread must not keep the process alive
        log.error("the model thread did not stop; exiting anyway")
        logging.shutdown()
        os._exit(code or 1)
    return code
