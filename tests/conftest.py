import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    """The tiny checkpoint set, built once (in a subprocess: dist_checkpointing spawns helpers)."""
    out = subprocess.run(
        [sys.executable, "-m", "songserve.pipeline.tiny"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return Path(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def megatron_cpu():
    import torch

    from songserve.pipeline.megatron_env import init_megatron

    torch.set_num_threads(1)
    init_megatron(torch.device("cpu"), 0, seed=0)
    return torch.device("cpu")
