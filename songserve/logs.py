"""Logging configured once, at each entry point."""

from __future__ import annotations

import logging
import warnings


def setup_logging(name: str, level: str = "INFO") -> None:
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s %(levelname)s {name} %(name)s: %(message)s",
    )
    # megatron-core warns at import that transformer-engine and apex are absent: expected here.
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
    warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor.*")
    for noisy in ("megatron.core.distributed", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
