"""P16: encoding an upload: the encoder's time per minute of audio, against the decoder's for the same minute.

What an upload costs a worker, on the project's tiny set (the CPU case; ``--release-widths 1`` builds the
release's decoder file at the golden YAML's widths, the GPU case): ``load_encoder`` → ``encode`` of a
minute of 44.1 kHz stereo music-like audio (chunks of ``ENCODE_CHUNK_FRAMES`` with 16 frames of
context, as a worker does), and, as the baseline measured in the same run, ``load_decoder`` →
``decode`` of the very codes it gave (chunks of ``DECODE_CHUNK_FRAMES``). Times are the process's CPU
time on the CPU (the VM is shared: wall time counts waits for a core), CUDA-synchronised wall time on a
GPU, best of ``--repeats`` interleaved rounds. One thread on the CPU. ``--smoke``: 1 s of audio, one round,
no warm-up.
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import args, report


def music(seconds: float, seed: int = 5) -> np.ndarray:
    """(2, n) float32: a few tones with vibrato and some noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 44100)) / 44100
    left = sum(0.2 * np.sin(2 * np.pi * f * t + 2 * np.sin(2 * np.pi * 0.3 * t)) for f in (110, 220, 440))
    right = sum(0.2 * np.sin(2 * np.pi * f * t) for f in (165, 330))
    x = np.stack([left, right]) + 0.03 * rng.standard_normal((2, t.size))
    return np.clip(x, -1, 1).astype(np.float32)


def clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return time.perf_counter()
    return time.process_time()


def main() -> None:
    a = args(__doc__.splitlines()[0], seconds=60.0, repeats=3, release_widths=0, device="cpu")
    from songserve.pipeline.config import DEFAULT_TINY_DIR
    from songserve.pipeline.stages.codec import load_decoder
    from songserve.pipeline.stages.encoder import load_encoder
    from songserve.pipeline.tiny.build import ensure_tiny_set
    from songserve.pipeline.tiny.decoder_release import FULL_SIZES, write_release_decoder

    torch.set_num_threads(1)
    device = torch.device(a.device)
    seconds = 1.0 if a.smoke else a.seconds
    repeats = 1 if a.smoke else a.repeats
    with tempfile.TemporaryDirectory() as tmp:
        if a.release_widths:
            yaml_path, ckpt = Path(tmp) / "dac.yaml", Path(tmp) / "dac.ckpt"
            write_release_decoder(yaml_path, ckpt, sizes=FULL_SIZES)
            which = "release widths"
        else:
            tiny = ensure_tiny_set(DEFAULT_TINY_DIR)
            yaml_path, ckpt = tiny / "decoder" / "config.yaml", tiny / "decoder" / "model.pth"
            which = "tiny set"
        t0 = time.perf_counter()
        enc = load_encoder(yaml_path, ckpt, device)
        enc_load = time.perf_counter() - t0
        t0 = time.perf_counter()
        dec = load_decoder(yaml_path, ckpt, device)
        dec_load = time.perf_counter() - t0
        audio = torch.from_numpy(music(seconds)).to(device)
        encode = decode = math.inf
        if not a.smoke:
            codes = enc.encode(audio, 512, 16)  # warm-up
        for _ in range(repeats):
            t = clock(device)
            codes = enc.encode(audio, 512, 16)
            encode = min(encode, clock(device) - t)
            t = clock(device)
            dec.decode(codes[None].to(device), 256, 16)
            decode = min(decode, clock(device) - t)
    per_minute = 60.0 / seconds
    report(
        "P16",
        f"encode {encode * per_minute:.2f} s per minute of audio ({which}, {device.type}, {seconds:g} s encoded, "
        f"{codes.shape[1]} frames) = {encode / decode:.2f}x the decoder's {decode * per_minute:.2f} s for the same "
        f"minute; loads: encoder {enc_load:.2f} s, decoder {dec_load:.2f} s",
    )


if __name__ == "__main__":
    main()
