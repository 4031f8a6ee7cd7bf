"""Each benchmark runs on a tiny input and prints its summary line (numbers are never checked)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import ROOT

SCRIPTS = sorted((p.stem for p in (ROOT / "bench").glob("p[0-9]*_*.py")), key=lambda s: int(s[1:].split("_")[0]))


FIGURES = list(range(1, 17))


def test_every_figure_has_a_script():
    assert [s.split("_")[0] for s in SCRIPTS] == [f"p{i}" for i in FIGURES]


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_smoke(script, tiny_dir):
    out = subprocess.run(
        [sys.executable, "-m", f"bench.{script}", "--smoke"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith(script.split("_")[0].upper() + " ")


def test_gpu_check_smoke_runs_its_figures_on_this_device():
    """bench/gpu_check.py runs only on the rare GPU machine; --smoke runs its code here at small shapes."""
    out = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", "--smoke"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line.split()[0] for line in out.stdout.splitlines() if line.startswith("GPU")]
    assert lines == ["GPU-build", "GPU-decode", "GPU-track"], out.stdout
