"""A test-tone worker (``--pipeline test``, what most dispatcher tests start) never loads torch or megatron.

The tone is numpy and the real export; loading torch and megatron-core would take longer than the
rest of the tone worker's start-up. A fresh interpreter walks the worker's own start-up (settings,
launcher flags, runtime, app), loads and runs one tone track, then says what it imported.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support.servers import ROOT

START_AND_RUN_ONE_TONE = """
import asyncio, json, sys
from songserve.process.settings import load_settings
from songserve.worker.settings import WorkerSettings
from songserve.schemas import WorkerGenerateRequest
from songserve.worker.launcher_flags import apply_launcher_flags
from songserve.worker.main import build_runtime, split_megatron_flags
from songserve.worker.app import create_app
from songserve.http.serving import GracefulServer, header_timeout_protocol

own, _ = split_megatron_flags(["--pipeline", "test", "--output-dir", sys.argv[1]])
s = apply_launcher_flags(load_settings(WorkerSettings, own))
runtime = build_runtime(s)
create_app(runtime)

async def one() -> str:
    await runtime.start()
    return (await runtime.generate(WorkerGenerateRequest(task_id="tone", duration=0.01))).wav_filename

wav = asyncio.run(one())
runtime.shutdown()
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"torch", "megatron", "transformers", "scipy"})
print(json.dumps({"wav": wav, "heavy": heavy}))
"""


def test_a_tone_worker_starts_and_runs_without_torch_or_megatron(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", START_AND_RUN_ONE_TONE, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert (tmp_path / got["wav"]).is_file()
    assert got["heavy"] == []
