"""Each benchmark runs on a tiny input and prints its summary line (numbers are never checked).

Each runs as ``python -m bench.pN --smoke``, forked from this test process's template that has torch
and megatron-core imported (tests/support/zygote.py): about 4 CPU-seconds less each of the eight that load the
model; what a benchmark measures in a child of its own (p12's and p13's memory) still starts fresh.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.support import zygote
from tests.support.servers import ROOT

SCRIPTS = sorted((p.stem for p in (ROOT / "bench").glob("p[0-9]*_*.py")), key=lambda s: int(s[1:].split("_")[0]))


FIGURES = list(range(1, 21))


def test_every_figure_has_a_script():
    assert [s.split("_")[0] for s in SCRIPTS] == [f"p{i}" for i in FIGURES]


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_smoke(script, tiny_dir):
    out = zygote.run("torch", ["-m", f"bench.{script}", "--smoke"], ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith(script.split("_")[0].upper() + " ")


def test_gpu_check_smoke_runs_its_table_on_this_device(tmp_path):
    """bench/gpu_check.sh runs only on the rare GPU machine; --smoke runs the same script here at tiny
    shapes: every decode mode at batch 1, 2 and 4 draws eager's tokens (bitwise on the CPU), and the
    song rows come out, in one table under OUT."""
    import importlib.util
    import json

    env = {**os.environ, "OUT": str(tmp_path)}
    out = subprocess.run(
        ["bash", "bench/gpu_check.sh", "--smoke"], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "setup: python" in out.stdout
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = {(r["mode"], r["batch"]): r for r in result["modes"]}
    assert set(rows) == {(m, b) for m in ("eager", "compiled", "graphs", "fused") for b in (1, 2, 4)}
    no_triton = importlib.util.find_spec("triton") is None  # then the fused rows say so and run eager
    for key, row in rows.items():
        assert row["tokens"] == 1.0, row
        assert row["ms_step"] > 0, row
        if key[0] != "eager" and not (key[0] == "fused" and no_triton):
            assert row["fallback"] is None, row
    assert [(s["takes"], "error" in s) for s in result["songs"]] == [(1, False), (4, False)]
    table = (tmp_path / "gpu_check.md").read_text()
    assert table.count("\n| fused |") == 3
