"""Uploads in bounded memory, through a real dispatcher and a real tone worker.

- A decoding bomb: a FLAC of a minute of silence at 384 kHz in 8 channels is 200 KB and decodes to
  737 MB of float samples; both processes that read it (the dispatcher checks it, the worker encodes
  it) decode it block by block, so each one's peak memory grows by its 44.1 kHz stereo size (21 MB)
  and a constant, not by the decoded source (decoded whole: ~2.3 GiB each).
- Twenty 40 MB WAV uploads at once: the bodies go to spooled files as they arrive and at most
  ``UPLOAD_CONCURRENCY`` are decoded at once, keeping no samples, so the dispatcher's peak grows by
  much less than the bytes in flight (held in memory: 4.3 × them) and ``/health`` answers throughout.
- One upload past ``UPLOAD_CONCURRENCY`` + ``UPLOAD_QUEUE`` is a 503 with ``Retry-After``, its body unread (on
  ACE-Step's port too, for a multipart task).
"""

from __future__ import annotations

import io
import threading
from concurrent.futures import ThreadPoolExecutor
from itertools import chain

import httpx
import numpy as np
import pytest
import soundfile as sf

from tests.support.http import TLS
from tests.support.load_probe import HealthWatch, lag_counts, peak_mib, raw_request
from tests.support.servers import Cluster, free_port, wait_for

MIB = 2**20


def silence_flac(seconds: int, rate: int, channels: int) -> bytes:
    buf = io.BytesIO()
    second = np.zeros((rate, channels), dtype=np.int16)
    with sf.SoundFile(buf, "w", rate, channels, format="FLAC", subtype="PCM_16") as f:
        for _ in range(seconds):
            f.write(second)
    return buf.getvalue()


def wav_of(megabytes: int, rate: int = 44100) -> bytes:
    frames = megabytes * 10**6 // 4  # 16-bit stereo
    t = np.arange(frames) / rate
    x = (0.3 * np.sin(2 * np.pi * 330 * t)[:, None] * np.array([1.0, 0.8])).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, x, rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def post(url: str, data: bytes, name: str = "x.flac", timeout: float = 600) -> httpx.Response:
    return httpx.post(
        f"{url}/uploads", files={"file": (name, data, "application/octet-stream")}, timeout=timeout, verify=TLS
    )


def test_a_small_file_that_decodes_to_gigabytes_costs_each_process_its_44k_size(tmp_path):
    bomb = silence_flac(60, 384_000, 8)
    assert len(bomb) < MIB  # 60 × 384,000 × 8 float32 samples: 737 MB decoded
    with Cluster(tmp_path, workers=1, delay=0.1, api_args=("--max-duration", "3")) as site:
        api, worker = site.api, site.workers[0]
        assert api is not None
        before = {"dispatcher": peak_mib(api.proc.pid), "worker": peak_mib(worker.proc.pid)}
        with HealthWatch(api.url, worker.url) as health:
            r = post(site.url, bomb)
            assert r.status_code == 200, r.text
            up = r.json()
            assert up["source"] == {
                "format": "FLAC",
                "subtype": "PCM_16",
                "sample_rate": 384000,
                "channels": 8,
                "frames": 23_040_000,
            }

            def settled():
                v = httpx.get(f"{site.url}/uploads/{up['upload_id']}", verify=TLS).json()
                return v["status"] in ("ready", "failed") and v

            done = wait_for(settled, timeout=600, interval=0.5)
        assert done["status"] == "ready", done  # the worker decoded it whole: 60 s of 44.1 kHz stereo
        assert done["duration_sec"] == 60.0
        growth = {"dispatcher": peak_mib(api.proc.pid), "worker": peak_mib(worker.proc.pid)}
        growth = {k: v - before[k] for k, v in growth.items()}
        print(f"peak growth MiB: {growth}; /health slowest {health.slowest:.2f} s")
        assert growth["dispatcher"] < 512, growth
        assert growth["worker"] < 512, growth
        assert health.failed == 0


def test_twenty_40mb_uploads_at_once_cost_less_than_their_bytes_and_health_answers(tmp_path):
    body = wav_of(40)
    args = ("--max-duration", "5", "--upload-max-mb", "64")
    with Cluster(tmp_path, workers=0, api_args=args) as site:  # no worker: uploads wait for one, stored
        api = site.api
        assert api is not None
        before = peak_mib(api.proc.pid)
        probes_before, over_before = lag_counts(api.url)
        with HealthWatch(api.url, timeout=30) as health, ThreadPoolExecutor(20) as pool:
            answers = list(pool.map(lambda i: post(site.url, body, f"take{i}.wav"), range(20)))
        probes, over = lag_counts(api.url)
        growth = peak_mib(api.proc.pid) - before
        in_flight = 20 * len(body) / MIB
        print(
            f"dispatcher peak growth {growth:.0f} MiB for {in_flight:.0f} MiB in flight; "
            f"/health slowest {health.slowest:.2f} s of {health.asked}; loop lag: {probes - probes_before:.0f} "
            f"probes, {over - over_before:.0f} over 1 s"
        )
        assert [a.status_code for a in answers] == [200] * 20, [a.text for a in answers if a.status_code != 200]
        assert all(a.json()["duration_sec"] == pytest.approx(len(body) / 4 / 44100, abs=0.01) for a in answers)
        assert growth < 1.5 * in_flight
        # The dispatcher's own loop never stalled a second (a wall-clock answer here also measures this
        # process: twenty threads sending 40 MB each hold its GIL while the watcher waits for it).
        assert over == over_before, f"{over - over_before:.0f} loop-lag probes over 1 s"
        assert health.failed == 0


def test_an_upload_past_the_line_is_503_with_retry_after_before_its_body_is_read(tmp_path):
    ace = free_port()
    args = ("--upload-concurrency", "1", "--upload-queue", "0", "--acestep-port", str(ace))
    with Cluster(tmp_path, workers=0, api_args=args) as site:
        assert site.api is not None
        port = site.api.port
        release = threading.Event()

        def held_body():  # one upload whose body stops half-way until the test lets it go on
            yield b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n'
            release.wait(60)
            yield wav_of(1) + b"\r\n--b--\r\n"

        head = (
            "POST /uploads HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=b\r\n"
            "Transfer-Encoding: chunked"
        )
        chunks = (b"%x\r\n%s\r\n" % (len(c), c) for c in chain(held_body(), [b""]))  # lazily: the wait is the sender's
        holder: dict[str, tuple[int, bytes, float]] = {}
        first = threading.Thread(target=lambda: holder.update(first=raw_request(port, head, rest=chunks, timeout=60)))
        first.start()
        small = wav_of(1)
        refused = wait_for(
            lambda: (r := post(site.url, small, "b.wav", timeout=30)).status_code == 503 and r, timeout=30
        )
        assert refused.headers["retry-after"] == "5"
        assert "UPLOAD_CONCURRENCY 1 + UPLOAD_QUEUE 0" in refused.json()["error"]
        repaint = httpx.post(  # ACE-Step's multipart may carry a source audio: the same line
            f"http://127.0.0.1:{ace}/release_task",
            data={"task_type": "repaint", "repainting_start": "1"},
            files={"src_audio": ("mine.wav", small, "audio/wav")},
            timeout=30,
            verify=TLS,
        )
        assert (repaint.status_code, repaint.headers.get("retry-after")) == (503, "5"), repaint.text
        plain = httpx.post(f"http://127.0.0.1:{ace}/release_task", json={"prompt": "x"}, timeout=30, verify=TLS)
        assert plain.status_code == 200, plain.text  # a task without a file waits in no line
        release.set()
        first.join(60)
        assert holder["first"][0] == 200, holder
        assert post(site.url, small, "c.wav", timeout=30).status_code == 200  # its place is free again
