"""The real worker process over real HTTP, with the tiny set."""

from __future__ import annotations

import concurrent.futures as cf
import io
import json

import httpx
import pytest
import soundfile as sf

from tests.support.http import TLS
from tests.support.servers import start_worker, wait_for, worker_refusal
from tests.support.tiny_site import lent

FRAME = 2048 / 44100


def _worker(mode: str, tmp_path_factory):
    w = start_worker(tmp_path_factory.mktemp(mode), "--runtime-mode", mode, name=mode)
    w.wait_healthy()
    return w


@pytest.fixture(scope="module")
def one_shot(tiny_dir, tmp_path_factory):
    w = _worker("one_shot", tmp_path_factory)
    yield w
    w.stop()


@pytest.fixture(scope="module")
def keep_loaded(shared_tiny):
    with lent(shared_tiny) as w:  # the process's tiny-model worker: keep_loaded (tests/support/tiny_site.py)
        yield w


def generate(worker, timeout=120, **body):
    payload = {"lyrics": "[verse]\nhello world\n你好世界", "tags": "pop, piano", "duration": 5 / 60, **body}
    return httpx.post(worker.url + "/generate", json=payload, timeout=timeout, verify=TLS)


def download(worker, name) -> bytes:
    r = httpx.get(f"{worker.url}/download/{name}", timeout=30, verify=TLS)
    assert r.status_code == 200, r.text
    return r.content


def test_five_second_track_files(one_shot):
    r = generate(one_shot, seed_override=11, task_id="five-sec", job_id="j1", track_index=1)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["status"] == "ok"
    assert out["seed"] == 11
    assert out["gpu_id"] == 0

    wav, sr = sf.read(io.BytesIO(download(one_shot, out["wav_filename"])))
    assert sr == 44100
    assert wav.shape[1] == 2
    seconds = wav.shape[0] / sr
    assert 4.5 - FRAME <= seconds <= 5.0 + FRAME
    assert wav.std() > 0.01  # untrained: noise, but not silence

    mp3 = download(one_shot, out["mp3_filename"])
    info = sf.info(io.BytesIO(mp3))
    assert info.samplerate == 44100
    assert info.channels == 2
    assert abs(info.frames / info.samplerate - seconds) < 0.1

    meta = json.loads(download(one_shot, out["json_filename"]))
    assert meta["request"]["lyrics"].startswith("[verse]")
    assert meta["request"]["tags"] == "pop, piano"
    assert meta["seed"] == 11
    assert meta["models"]["backbone"] == "default_backbone"
    assert meta["models"]["superres"] == "default_superres"
    assert meta["tokens"]["backbone_new"] == 2 * meta["tokens"]["frames"] > 0
    assert meta["tokens"]["backbone_prompt"] > 5
    for stage in ("backbone_sec", "superres_sec", "decoder_sec", "export_sec"):
        assert meta["timings"][stage] > 0
    assert out["wav_filename"].endswith(".wav")
    assert len(out["wav_filename"].split("_")[-1]) == len("abcdef12.wav")


@pytest.mark.parametrize("mode", ["one_shot", "keep_loaded"])
def test_same_seed_same_bytes_different_seed_different_audio(mode, request):
    worker = request.getfixturevalue(mode)
    a = generate(worker, seed_override=7, duration=2 / 60).json()
    b = generate(worker, seed_override=7, duration=2 / 60).json()
    c = generate(worker, seed_override=8, duration=2 / 60).json()
    wa, wb, wc = (download(worker, x["wav_filename"]) for x in (a, b, c))
    assert wa == wb
    assert wa != wc


def test_runtime_mode_flags_after_a_task(one_shot, keep_loaded):
    for worker, loaded in ((one_shot, False), (keep_loaded, True)):
        assert generate(worker, duration=1 / 60).status_code == 200
        h = httpx.get(worker.url + "/health", verify=TLS).json()
        assert h["status"] == "idle"
        assert h["backbone_loaded"] is True
        assert h["superres_loaded"] is loaded
        assert h["decoder_loaded"] is loaded
        assert h["runtime_mode"] == ("keep_loaded" if loaded else "one_shot")


def test_cancel_in_backbone_is_fast_and_the_next_task_runs(one_shot):
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(generate, one_shot, duration=4.0, task_id="to-cancel")
        wait_for(lambda: httpx.get(one_shot.url + "/health", verify=TLS).json()["phase"] == "backbone", timeout=30)
        # A second task while busy: 409 with the busy body.
        busy = generate(one_shot, task_id="second")
        assert busy.status_code == 409
        assert busy.json()["status"] == "busy"
        assert httpx.post(one_shot.url + "/cancel/to-cancel", verify=TLS).status_code == 200
        r = fut.result(timeout=10)  # a 4-minute song: it can only come back this soon by cancelling
    assert r.json()["status"] == "cancelled"
    assert httpx.get(one_shot.url + "/tasks/to-cancel", verify=TLS).json()["status"] == "cancelled"
    nxt = generate(one_shot, duration=1 / 60)
    assert nxt.status_code == 200
    assert nxt.json()["status"] == "ok"


def test_finished_task_can_be_collected_later(one_shot):
    r = generate(one_shot, duration=1 / 60, task_id="collect-me").json()
    view = httpx.get(one_shot.url + "/tasks/collect-me", verify=TLS).json()
    assert view["status"] == "done"
    assert view["result"]["wav_filename"] == r["wav_filename"]
    missing = httpx.get(one_shot.url + "/tasks/never", verify=TLS)
    assert missing.status_code == 404
    assert missing.json()["status"] == "error"


@pytest.mark.parametrize(
    "name", ["..%2Fx", "%2e%2e%2Fetc%2Fpasswd", ".hidden", "nope.wav", "x%00.wav", "..", "%2Fetc%2Fpasswd"]
)
def test_download_only_serves_plain_names_it_wrote(one_shot, name):
    r = httpx.get(f"{one_shot.url}/download/{name}", verify=TLS)
    if r.request.url.path == "/":  # httpx folds /download/.. into /: the worker's note, which is no file
        assert r.json()["service"] == "songserve worker"
    else:
        assert r.status_code == 404
        assert r.json()["status"] == "error"
    r = httpx.get(f"{one_shot.url}/download/../x", verify=TLS)
    assert r.status_code == 404


def test_symlink_in_the_output_folder_is_not_served(one_shot, tmp_path):
    out_dir = one_shot.log_path.parent / "one_shot_audio"
    (out_dir / "link.wav").symlink_to("/etc/passwd")
    assert httpx.get(f"{one_shot.url}/download/link.wav", verify=TLS).status_code == 404


def test_bad_request_names_the_field(one_shot):
    r = httpx.post(one_shot.url + "/generate", json={"duration": -1}, verify=TLS)
    assert r.status_code == 422
    body = r.json()
    assert body["status"] == "error"
    assert "duration" in body["error"]
    assert body["detail"]
    r = generate(one_shot, backbone_name="nope", duration=1 / 60)
    assert r.status_code == 400
    assert "nope" in r.json()["error"]
    assert httpx.get(one_shot.url + "/health", verify=TLS).json()["status"] == "idle"


def test_wrong_checkpoint_path_refuses_to_start_with_the_path(tmp_path):
    out = worker_refusal("--checkpoints-dir", str(tmp_path / "no-such"), timeout=60)
    assert out.returncode != 0
    assert str(tmp_path / "no-such") in out.stderr


def test_mismatched_decoder_refuses_with_one_line(tiny_dir, tmp_path):
    (tmp_path / "config.yaml").write_text(
        "decoder: {n_filters: 8, upsampling_ratios: [8, 8, 8, 4]}\n"
        "quantizer: {n_codebooks: 64, codebook_size: 1024, latent_dim: 32}\n"
    )
    out = worker_refusal("--checkpoints-dir", str(tiny_dir), "--decoder-config-path", str(tmp_path / "config.yaml"))
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("worker: Decoder checkpoint")
    assert "does not match" in last


def test_failure_inside_a_task_is_local_and_clear(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the output folder should be")
    w = start_worker(tmp_path, "--pipeline", "test", "--output-dir", str(blocker), name="broken-disk")
    try:
        w.wait_healthy()
        r = httpx.post(w.url + "/generate", json={"duration": 0.05, "task_id": "disk"}, timeout=60, verify=TLS)
        assert r.status_code == 500
        body = r.json()
        assert body["status"] == "error"
        assert body["error"].startswith("The worker could not write its output files")
        assert str(tmp_path) not in body["error"]
        assert "Traceback" not in r.text
        assert "Traceback" in w.log_tail(20_000)  # the traceback goes to the log
        h = httpx.get(w.url + "/health", verify=TLS).json()
        assert h["status"] == "idle"
        assert h["task_id"] is None
        assert httpx.get(w.url + "/tasks/disk", verify=TLS).json()["status"] == "error"
    finally:
        w.stop()


def test_the_worker_exports_prometheus_metrics(tmp_path):
    w = start_worker(tmp_path, "--pipeline", "test", name="metrics")
    try:
        w.wait_healthy()
        assert (
            httpx.post(
                w.url + "/generate", json={"duration": 0.02, "task_id": "m1"}, timeout=60, verify=TLS
            ).status_code
            == 200
        )
        text = httpx.get(w.url + "/metrics", timeout=10, verify=TLS).text
        assert 'songserve_worker_tasks_total{outcome="done"} 1.0' in text
        assert "songserve_worker_task_seconds_count 1.0" in text
        assert "songserve_worker_busy 0.0" in text
        assert "process_resident_memory_bytes" in text
    finally:
        w.stop()
