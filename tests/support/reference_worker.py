"""A stand-in for the reference backend's worker: its HTTP surface, with the model replaced by a tone.

    python tests/support/reference_worker.py --worker-port P --output-dir DIR [--delay-s S] [--requests-log FILE]
        [--hold-file FILE]

The surface follows the reference's ``backend/backend_worker.py`` (public Khala repository):
- ``GET /health``: exactly ``status, phase, gpu_id, seed, progress, progress_detail,
  backbone_loaded`` (the model's name), ``superres_loaded`` (name), ``decoder_loaded`` (bool);
  no task id;
- ``GET /config``: ``backbone_models, superres_models, genre_options, language_options``;
- ``POST /generate``: its request model (``duration`` is an int: a fraction is a 422); runs the
  request synchronously; answers 200 with ``{"status": "busy", …}`` while busy, 200 with
  ``{"status": "error", "error": <traceback>}`` on failure, else ``status, mp3_filename,
  wav_filename, duration_sec, backbone_tokens, gpu_id, seed`` (no JSON file, no task id);
  progress as ``"N/M tokens"`` with M = 2,584 × (duration + 1) in the backbone phase;
- ``GET /download/{filename}``: the file, or 200 with a JSON error body when it is missing;
- no ``/cancel``, no ``/tasks``, no token.
Each request body is appended to ``--requests-log`` (JSON lines) so tests can see what it received.
Tags ``"fail"`` make the model raise, to test the error path. ``--hold-file`` (ours, for tests): after
the backbone's first step a take waits while that file exists, so a test keeps it generating for as
long as it needs instead of a delay long enough for a loaded machine.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import traceback
import uuid
from pathlib import Path

import numpy as np
import soundfile as sf
import uvicorn
from fastapi import FastAPI
from fastapi.responses import FileResponse
from pydantic import BaseModel

TOKENS_PER_MINUTE = 2584
SAMPLE_RATE = 44100


class GenerateRequest(BaseModel):  # the reference worker's request model
    genre: str = "Pop"
    language: str = "Chinese"
    tags: str = ""
    description: str = ""
    duration: int = 2
    lyrics: str = ""
    backbone_name: str = ""
    superres_name: str = ""
    top_k_bb: int = 80
    top_k_sr: int = 10
    temperature: float = 1.0
    superres_text_mode: str = "same_as_backbone"
    raw_user_input: str = ""
    raw_mode: str = ""
    raw_prompt_mode: str = ""


def build_app(out: Path, delay: float, requests_log: Path | None, hold: Path | None = None) -> FastAPI:
    app = FastAPI()
    state = {"status": "idle", "phase": "idle", "progress": 0, "progress_detail": ""}
    lock = threading.Lock()

    def phase(name: str, progress: int = 0, detail: str = "") -> None:
        state.update(phase=name, progress=progress, progress_detail=detail)

    def run(req: GenerateRequest) -> dict[str, object]:
        estimated = TOKENS_PER_MINUTE * (req.duration + 1)
        phase("backbone")
        steps = 10
        for i in range(1, steps + 1):  # backbone: most of the time, with token progress
            time.sleep(delay * 0.6 / steps)
            done = estimated * i // (steps + 2)
            state.update(progress=min(99, done * 100 // estimated), progress_detail=f"{done}/{estimated} tokens")
            while i == 1 and hold is not None and hold.exists():
                time.sleep(0.02)
        if req.tags == "fail":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        phase("superres")
        time.sleep(delay * 0.3)
        phase("decoding", 0, "decoding audio")
        time.sleep(delay * 0.1)
        seconds = 2.0
        t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
        wave = (0.2 * np.sin(2 * np.pi * 330 * t)).astype(np.float32)
        file_id = f"{time.strftime('%Y%m%d_%H%M%S')}_{uuid.uuid4().hex[:8]}"
        sf.write(out / f"{file_id}.wav", np.stack([wave, wave], 1), SAMPLE_RATE)
        sf.write(out / f"{file_id}.mp3", np.stack([wave, wave], 1), SAMPLE_RATE, format="MP3")
        return {
            "status": "ok",
            "mp3_filename": f"{file_id}.mp3",
            "wav_filename": f"{file_id}.wav",
            "duration_sec": seconds,
            "backbone_tokens": estimated // 2,
            "gpu_id": 0,
            "seed": 1234,
        }

    @app.get("/health")
    def health() -> dict[str, object]:
        return {
            "status": state["status"],
            "phase": state["phase"],
            "gpu_id": 0,
            "seed": 1234,
            "progress": state["progress"],
            "progress_detail": state["progress_detail"],
            "backbone_loaded": "default_backbone",
            "superres_loaded": "default_superres",
            "decoder_loaded": True,
        }

    @app.get("/config")
    def config() -> dict[str, object]:
        return {
            "backbone_models": ["default_backbone"],
            "superres_models": ["default_superres"],
            "genre_options": ["Pop", "Rock"],
            "language_options": ["Chinese", "English", "Instrumental"],
        }

    @app.post("/generate")
    def generate(req: GenerateRequest) -> dict[str, object]:
        if requests_log is not None:
            with requests_log.open("a") as f:
                f.write(json.dumps(req.model_dump()) + "\n")
        with lock:
            if state["status"] == "busy":
                return {"status": "busy", "error": "Worker is currently busy."}
            state["status"] = "busy"
        try:
            return run(req)
        except Exception:
            return {"status": "error", "error": traceback.format_exc()}
        finally:
            state["status"] = "idle"
            phase("idle")

    @app.get("/download/{filename}", response_model=None)
    def download(filename: str) -> FileResponse | dict[str, str]:
        path = out / filename
        if not path.is_file():
            return {"status": "error", "error": f"File not found: {filename}"}
        return FileResponse(path, media_type="audio/mpeg" if filename.endswith(".mp3") else "audio/wav")

    return app


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker-port", type=int, default=8001)
    p.add_argument("--output-dir", type=Path, required=True)
    p.add_argument("--delay-s", type=float, default=1.0)
    p.add_argument("--requests-log", type=Path)
    p.add_argument("--hold-file", type=Path)
    a = p.parse_args()
    a.output_dir.mkdir(parents=True, exist_ok=True)
    app = build_app(a.output_dir, a.delay_s, a.requests_log, a.hold_file)
    uvicorn.run(app, host="127.0.0.1", port=a.worker_port, log_level="warning")


if __name__ == "__main__":
    main()
