"""P14: live audio: time to the first audio at a listener, the cost of listening, and the preview's quality.

Real processes: one tiny-set model worker (keep_loaded) and a dispatcher. The same 1-minute song
(same seed) is generated in interleaved rounds, without a listener (the baseline, measured in the
same run) and with one that opens ``GET /job/{id}/track/0/stream`` (MP3, the default) right after
the submit. Times are wall seconds from the submit: to the first audio bytes at the listener
(MP3 frames, not the header), and to the job's completion. The figure: first audio as a share of
the track's time, and the track's time with a listener over without (the median of the rounds).

Quality of the preview against the final take (from a WAV stream of a further take): log-spectral
distance in dB (STFT of 2,048 samples) and SNR, once with the request's top-k 10 in
super-resolution (the preview samples its own levels: a different take of the same coarse codes)
and once with top-k 1 (greedy: the windows alone differ from the whole song's pass).
``--preview-levels`` sets the worker's ``PREVIEW_LEVELS`` (0, the default: auto, 16 levels on the CPU;
64: every level).

``--smoke``: a 2 s song, one round, no warm-up take.
"""

from __future__ import annotations

import io
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import soundfile as sf

from bench.common import args, report
from tests.support.servers import Cluster, cluster_of, start_worker

SONG = {"tags": "pop, piano", "lyrics": "[verse]\nhear it\nas it is made", "num_tracks": 1, "seed": 7}
TERMINAL = {"completed", "partial", "failed", "cancelled"}


def run(site: Cluster, seconds: float, listen: str | None, **extra: object) -> dict[str, object]:
    """One take: seconds to completion, and to the first audio bytes when ``listen`` is a format."""
    t0 = time.perf_counter()
    r = httpx.post(f"{site.url}/generate", json={**SONG, "duration": seconds / 60, **extra}, timeout=30)
    r.raise_for_status()
    job = r.json()["job_id"]
    got: dict[str, object] = {"first": None, "body": bytearray()}

    def hear() -> None:
        body = got["body"]
        assert isinstance(body, bytearray)
        url = f"{site.url}/job/{job}/track/0/stream"
        with httpx.stream("GET", url, params={"format": listen}, timeout=httpx.Timeout(10, read=600)) as s:
            for piece in s.iter_raw():
                body.extend(piece)
                if got["first"] is None and len(body) > (44 if listen == "wav" else 0):
                    got["first"] = time.perf_counter() - t0

    listener = threading.Thread(target=hear, daemon=True) if listen else None
    if listener is not None:
        listener.start()
    with httpx.Client(base_url=site.url, timeout=10) as http:  # one connection: a bare httpx.get costs ~30 ms CPU
        while (view := http.get(f"/job/{job}").json())["status"] not in TERMINAL:
            time.sleep(0.05)
    got["total"] = time.perf_counter() - t0
    if listener is not None:
        listener.join(60)
    assert view["status"] == "completed", view
    got["job"] = job
    return got


def quality(site: Cluster, seconds: float, top_k_sr: int) -> tuple[float, float]:
    """(log-spectral distance dB, SNR dB) of the live WAV stream against the final WAV of one take."""
    got = run(site, seconds, "wav", top_k_sr=top_k_sr, preview=True)  # made from the first frames on
    body = got["body"]
    assert isinstance(body, bytearray)
    live = np.frombuffer(bytes(body[44:]), dtype="<i2").reshape(-1, 2).astype(np.float64).mean(axis=1)
    final_wav = httpx.get(f"{site.url}/job/{got['job']}/track/0/wav", timeout=30).content
    final = sf.read(io.BytesIO(final_wav), dtype="int16")[0].astype(np.float64).mean(axis=1)
    n = min(len(live), len(final))
    live, final = live[:n], final[:n]
    snr = 10 * np.log10((final**2).sum() / max(((final - live) ** 2).sum(), 1e-9))

    def spectrum(x: np.ndarray) -> np.ndarray:
        frames = x[: len(x) // 2048 * 2048].reshape(-1, 2048) * np.hanning(2048)
        return 10 * np.log10(np.abs(np.fft.rfft(frames, axis=1)) ** 2 + 1e-6)

    lsd = float(np.mean(np.sqrt(np.mean((spectrum(live) - spectrum(final)) ** 2, axis=1))))
    return lsd, float(snr)


def main() -> None:
    a = args(__doc__, seconds=60.0, rounds=3, preview_levels=0)
    seconds, rounds = (2.0, 1) if a.smoke else (a.seconds, a.rounds)
    with tempfile.TemporaryDirectory() as tmp:
        w = start_worker(
            Path(tmp),
            "--runtime-mode",
            "keep_loaded",
            "--eoa-min-share",
            "1",
            "--preview-levels",
            str(a.preview_levels),
            name="p14",
        )
        site: Cluster | None = None
        try:
            w.wait_healthy(timeout=300)
            site = cluster_of(Path(tmp), [w])
            if not a.smoke:
                run(site, seconds, None)  # warm-up: first-use costs are not the listener's
            quiet, heard = [], []
            for _ in range(rounds):  # interleaved: the VM's load drifts between rounds
                quiet.append(run(site, seconds, None))
                heard.append(run(site, seconds, "mp3"))
            lsd10, snr10 = quality(site, seconds, 10)
            lsd1, snr1 = quality(site, seconds, 1)
        finally:
            (site or w).stop()  # a cluster stops its dispatcher and its worker
    t_quiet = statistics.median(float(g["total"]) for g in quiet)  # type: ignore[arg-type]
    t_heard = statistics.median(float(g["total"]) for g in heard)  # type: ignore[arg-type]
    first = statistics.median(float(g["first"]) for g in heard)  # type: ignore[arg-type]
    report(
        "P14",
        f"{seconds:.0f}s tiny-set song, PREVIEW_LEVELS {a.preview_levels or 'auto (16)'}, {rounds} rounds: first audio at the listener {first:.2f}s = "
        f"{first / t_heard:.0%} of the track ({t_heard:.2f}s); track with a listener {t_heard / t_quiet:.2f}x "
        f"without ({t_quiet:.2f}s); preview vs final: LSD {lsd10:.1f} dB, SNR {snr10:.1f} dB (top-k 10), "
        f"LSD {lsd1:.1f} dB, SNR {snr1:.1f} dB (top-k 1)",
    )


if __name__ == "__main__":
    main()
