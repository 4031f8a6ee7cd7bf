"""Our encoder against the reference's own ``DacRVQ.encode``, on the same weights and the same WAV.

Not a figure of its own (no P-number): a local check, run by hand where the reference's snapshot is.
The reference's code is never part of this repository: given the snapshot's git directory
(``--mirror``), ``models/Decoder/{dac,rvq,dac_rvq}.py`` are exported into a temporary folder at run
time and imported from there. They need ``einops`` (give a folder holding it with ``--extra-path``
if the environment lacks it: ``pip install --target /tmp/refdeps einops``); ``lightning`` is replaced
by a stand-in whose ``LightningModule`` is ``torch.nn.Module`` (``DacRVQ`` uses nothing else of it).

What is compared, for a stereo 44.1 kHz 16-bit WAV (``--wav``, or a generated one of ``--seconds``):
- the reference: its YAML read (``${…}`` resolved), ``DacRVQ(configs)``, the checkpoint's
  ``generator.*`` tensors loaded with ``strict=True``, ``eval()``, ``encode`` of the WAV's samples;
- ours: the samples as an upload reads them (``songserve/audio/reading.py``), ``load_encoder`` → ``encode``;
  with ``--url`` also a running dispatcher's ``POST /uploads`` then ``GET /uploads/{id}/codes``.
Printed: frames on each side, the share of codes equal, and where the first difference is.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np

from bench.common import ROOT

REFERENCE_FILES = ("models/Decoder/dac.py", "models/Decoder/rvq.py", "models/Decoder/dac_rvq.py")


def export_reference(mirror: Path, into: Path) -> None:
    """The reference's decoder package files, from its git directory into ``into`` (never into the repo)."""
    for name in REFERENCE_FILES:
        text = subprocess.run(["git", f"--git-dir={mirror}", "show", f"HEAD:{name}"], capture_output=True, check=True)
        (into / Path(name).name).write_bytes(text.stdout)


def reference_model(yaml_path: Path, ckpt: Path, folder: Path):  # type: ignore[no-untyped-def]
    import torch
    import yaml

    from songserve.pipeline.checkpoints.decoder_config import resolve_interpolations

    stand_in = types.ModuleType("lightning")
    stand_in.LightningModule = torch.nn.Module  # type: ignore[attr-defined]
    sys.modules.setdefault("lightning", stand_in)
    sys.path.insert(0, str(folder))
    from dac_rvq import DacRVQ  # type: ignore[import-not-found]

    configs = resolve_interpolations(yaml.safe_load(yaml_path.read_text()), str(yaml_path))
    model = DacRVQ(configs)
    sd = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    gen = {k[len("generator.") :]: v for k, v in sd.items() if k.startswith("generator.")}
    model.load_state_dict(gen, strict=True)
    return model.eval()


def music_wav(seconds: float, seed: int = 7) -> bytes:
    """A stereo 44.1 kHz 16-bit WAV of a few tones with vibrato and some noise, loud enough to use the codes."""
    import soundfile as sf

    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 44100)) / 44100
    left = sum(0.2 * np.sin(2 * np.pi * f * t + 3 * np.sin(2 * np.pi * 0.5 * t)) for f in (110, 220, 330, 587))
    right = sum(0.2 * np.sin(2 * np.pi * f * t + 1.0) for f in (147, 294, 440))
    x = np.stack([left, right], 1) + 0.05 * rng.standard_normal((t.size, 2))
    buf = io.BytesIO()
    sf.write(buf, np.clip(x, -1, 1), 44100, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def compare(ours: np.ndarray, ref: np.ndarray) -> str:
    if ours.shape != ref.shape:
        return f"shapes differ: ours {ours.shape}, reference {ref.shape}"
    same = ours == ref
    line = f"{ours.shape[1]} frames, codes equal {same.mean():.6f} ({int((~same).sum())} of {same.size} differ"
    if not same.all():
        levels, frames = np.nonzero(~same)
        line += f"; first at level {levels.min()}, {len(set(frames.tolist()))} frames touched"
    return line + ")"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mirror", type=Path, required=True, help="the reference snapshot's git directory")
    ap.add_argument(
        "--release",
        type=Path,
        help="a release-shaped set (python -m songserve.pipeline.tiny "
        "--layout release DIR); default: one built in a temporary folder",
    )
    ap.add_argument("--wav", type=Path, help="a stereo 44.1 kHz WAV; default: a generated one")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--full", action="store_true", help="the golden YAML's widths (FULL_SIZES) instead of tiny ones")
    ap.add_argument("--extra-path", type=Path, help="a folder with einops, put on sys.path")
    ap.add_argument("--url", help="also a running dispatcher's POST /uploads and GET /uploads/{id}/codes")
    a = ap.parse_args()
    import torch

    from songserve.audio import codes
    from songserve.audio.reading import read_audio
    from songserve.pipeline.stages.encoder import load_encoder
    from songserve.pipeline.tiny.build import RELEASE_LAYOUT
    from songserve.pipeline.tiny.decoder_release import FULL_SIZES, write_release_decoder

    torch.set_num_threads(1)
    if a.extra_path:
        sys.path.append(str(a.extra_path))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if a.release:
            yaml_path, ckpt = (
                a.release / RELEASE_LAYOUT["decoder_config"],
                a.release / RELEASE_LAYOUT["decoder_checkpoint"],
            )
        else:
            yaml_path, ckpt = folder / "dac.yaml", folder / "dac.ckpt"
            write_release_decoder(yaml_path, ckpt, sizes=FULL_SIZES if a.full else None)
        export_reference(a.mirror, folder)
        wav = a.wav.read_bytes() if a.wav else music_wav(a.seconds)
        pcm, facts = read_audio(wav)
        ref_model = reference_model(yaml_path, ckpt, folder)
        t0 = time.perf_counter()
        with torch.no_grad():
            ref = ref_model.encode(torch.from_numpy(pcm)[None])[:, 0].numpy()
        t_ref = time.perf_counter() - t0
        enc = load_encoder(yaml_path, ckpt, torch.device("cpu"))
        t0 = time.perf_counter()
        ours = enc.encode(torch.from_numpy(pcm), chunk_frames=0).numpy()
        t_ours = time.perf_counter() - t0
        print(
            f"input: {facts.duration_sec:.2f} s, {pcm.shape[1]} samples; reference {t_ref:.2f} s, ours {t_ours:.2f} s"
        )
        print(f"encoder (one pass) vs reference: {compare(ours, ref)}")
        chunked = enc.encode(torch.from_numpy(pcm), chunk_frames=64, context_frames=16).numpy()
        print(f"encoder (chunks of 64 frames, 16 of context) vs reference: {compare(chunked, ref)}")
        if a.url:
            import httpx

            r = httpx.post(f"{a.url}/uploads", files={"file": ("take.wav", wav, "audio/wav")}, timeout=120)
            r.raise_for_status()
            upload = r.json()["upload_id"]
            deadline = time.monotonic() + 600
            while (state := httpx.get(f"{a.url}/uploads/{upload}", timeout=10).json())["status"] not in (
                "ready",
                "failed",
            ):
                if time.monotonic() > deadline:
                    raise TimeoutError(state)
                time.sleep(0.2)
            grid = codes.decode(httpx.get(f"{a.url}/uploads/{upload}/codes", timeout=60).content)
            print(f"GET /uploads/{upload}/codes vs reference: {compare(grid.codes.astype(np.int64), ref)}")


if __name__ == "__main__":
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    main()
