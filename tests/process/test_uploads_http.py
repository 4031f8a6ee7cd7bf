"""Uploads through a real dispatcher and a real tone worker over HTTP (and two dispatchers on PostgreSQL).

The tone worker's encode is deterministic (``tone_codes`` of the audio as ``audio_in`` reads it), so
the dispatcher's side is checked here at tone speed: what it refuses and stores, the encoding's
queue (served before tracks), the codes route, continuing an upload (ready or still encoding),
failures and deletion. The model's side is ``test_upload_model.py``.
"""

from __future__ import annotations

import io
import sqlite3
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf

from songserve.audio import codes
from songserve.audio.reading import read_audio
from songserve.pipeline.numbers import FRAMES_PER_SECOND
from songserve.pipeline.testing.tone import tone_codes
from tests.support.http import TLS
from tests.support.servers import Cluster, ServerProcess, free_port, start_reference_worker, start_worker, wait_for

UPLOAD_MB = 2.0
MAX_MINUTES = 0.25  # 15 s: the longest song (and so the longest upload) here


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    args = ("--upload-max-mb", str(UPLOAD_MB), "--max-duration", str(MAX_MINUTES))
    c = Cluster(tmp_path_factory.mktemp("uploads"), workers=1, delay=0.6, api_args=args, threads=True)
    yield c
    c.stop()


def audio(seconds: float, rate: int = 44100, channels: int = 2, fmt: str = "WAV", seed: int = 1) -> bytes:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    level = 0.2 + 0.2 * np.sin(2 * np.pi * 0.5 * t)  # a level that moves, so the tone codes do
    x = np.stack([level * np.sin(2 * np.pi * 220 * (c + 1) * t) for c in range(channels)], 1)
    buf = io.BytesIO()
    sf.write(buf, np.clip(x + 0.01 * rng.standard_normal(x.shape), -1, 1), rate, format=fmt)
    return buf.getvalue()


def post_upload(site: Cluster, data: bytes, name: str = "demo.wav") -> httpx.Response:
    return httpx.post(
        f"{site.url}/uploads", files={"file": (name, data, "application/octet-stream")}, timeout=60, verify=TLS
    )


def upload(site: Cluster, data: bytes, name: str = "demo.wav") -> dict:
    r = post_upload(site, data, name)
    assert r.status_code == 200, r.text
    return dict(r.json())


def view(site: Cluster, upload_id: str) -> dict:
    return dict(httpx.get(f"{site.url}/uploads/{upload_id}", timeout=10, verify=TLS).json())


def wait_upload(site: Cluster, upload_id: str) -> dict:
    return wait_for(lambda: (v := view(site, upload_id))["status"] in ("ready", "failed") and v, timeout=60)


def grid(site: Cluster, path: str) -> codes.CodeGrid:
    r = httpx.get(f"{site.url}{path}", timeout=10, verify=TLS)
    assert r.status_code == 200, r.text
    return codes.decode(r.content)


def generate(site: Cluster, **body) -> dict:
    r = httpx.post(
        f"{site.url}/generate", json={"tags": "pop", "lyrics": "[verse]\nla", **body}, timeout=30, verify=TLS
    )
    assert r.status_code == 200, r.text
    return dict(r.json())


def stored(site: Cluster) -> tuple[list[str], int]:
    """What is kept of uploads: their folders and their rows."""
    folder = site.tmp / "state" / "results" / "uploads"
    with sqlite3.connect(f"file:{site.tmp / 'state' / 'jobs.sqlite3'}?mode=ro", uri=True) as db:
        rows = db.execute("SELECT COUNT(*) FROM uploads").fetchone()[0]
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else [], int(rows)


def test_an_upload_is_stored_encoded_and_serves_the_workers_codes(site):
    data = audio(8.0)
    first = upload(site, data)
    assert first["status"] == "queued"
    assert first["duration_sec"] == 8.0
    assert first["frames"] == 8 * 44100 // 2048 == 172
    assert first["source"]["format"] == "WAV"
    done = wait_upload(site, first["upload_id"])
    assert done["status"] == "ready", done
    assert done["codes"] == f"/uploads/{first['upload_id']}/codes"
    g = grid(site, done["codes"])
    assert g.header["upload_id"] == first["upload_id"]
    assert g.header["frame_rate"] == pytest.approx(FRAMES_PER_SECOND)
    assert np.array_equal(g.codes, tone_codes(read_audio(data)[0]))  # the worker's grid, as it answered
    assert (site.tmp / "state" / "results" / "uploads" / first["upload_id"] / "source.wav").read_bytes() == data


@pytest.mark.parametrize(
    ("data", "fmt"),
    [
        (audio(3.0, rate=22050), "WAV"),
        (audio(3.0, rate=48000), "WAV"),
        (audio(3.0, channels=1), "WAV"),
        (audio(3.0, rate=48000, fmt="MP3"), "MP3"),
        (audio(3.0, rate=22050, channels=1, fmt="FLAC"), "FLAC"),
        (audio(3.0, channels=6, fmt="OGG"), "OGG"),
    ],
    ids=["wav-22k", "wav-48k", "wav-mono", "mp3-48k", "flac-22k-mono", "ogg-6ch"],  # an Ogg's serial is random
)
def test_any_rate_channels_and_format_encode(site, data, fmt):
    u = upload(site, data, f"x.{fmt.lower()}")
    pcm, facts = read_audio(data)
    assert u["source"]["format"] == fmt
    assert u["frames"] == pcm.shape[1] // 2048
    assert wait_upload(site, u["upload_id"])["status"] == "ready"
    assert np.array_equal(grid(site, f"/uploads/{u['upload_id']}/codes").codes, tone_codes(pcm))


def _truncated_wav() -> bytes:
    data = audio(2.0)
    return data[: len(data) // 2]


@pytest.mark.parametrize(
    ("data", "status", "says"),
    [
        (b"[verse]\nthese are lyrics, not audio\n" * 30, 422, "Field 'file': the file is not audio that can be read"),
        (b"", 422, "Field 'file': the file is empty"),
        (_truncated_wav(), 422, "Field 'file': the file is cut short"),
        (audio(20.0, fmt="MP3"), 422, "longer than the longest song the model can continue (15.0 s)"),
        (
            b"\0" * int(UPLOAD_MB * 2**20 + 100),
            413,
            "The file is larger than UPLOAD_MAX_MB (2 MB); nothing was stored.",
        ),
    ],
    ids=["text", "empty", "truncated-wav", "too-long", "over-the-cap"],
)
def test_what_cannot_be_encoded_is_refused_naming_why_and_nothing_is_stored(site, data, status, says):
    before = stored(site)
    r = post_upload(site, data)
    assert r.status_code == status, r.text
    assert says in r.json()["error"]
    assert stored(site) == before


def test_a_request_without_a_file_names_the_field(site):
    r = httpx.post(f"{site.url}/uploads", data={"name": "x"}, timeout=10, verify=TLS)
    assert r.status_code == 422
    assert r.json()["error"].startswith("Field 'file'")


def test_continuing_a_ready_upload_keeps_its_frames_in_every_level(site):
    u = wait_upload(site, upload(site, audio(6.0, seed=4))["upload_id"])
    before = grid(site, u["codes"])
    job = generate(site, continue_from={"upload_id": u["upload_id"]}, duration=0.2, num_tracks=2, seed=5)
    done = site.wait_job(job["job_id"])
    assert done["status"] == "completed", done
    for t in done["tracks"]:
        g = grid(site, t["files"]["codes"])
        assert g.frames == int(12 * FRAMES_PER_SECOND)
        assert np.array_equal(g.codes[:, : before.frames], before.codes)  # the whole upload, all 64 levels
        assert t["metadata"]["continued"]["frames"] == before.frames
        assert t["metadata"]["continued"]["origin"] == f"upload/{u['upload_id']}"
        assert t["metadata"]["batch_size"] == 2  # the takes of one prefix as one batch
    job = generate(site, continue_from={"upload_id": u["upload_id"], "at_sec": 2.0}, duration=0.1, num_tracks=1)
    t = site.wait_job(job["job_id"])["tracks"][0]
    keep = int(2.0 * FRAMES_PER_SECOND)
    assert t["metadata"]["continued"]["frames"] == keep
    assert np.array_equal(grid(site, t["files"]["codes"]).codes[:, :keep], before.codes[:, :keep])


def test_an_upload_repainted_in_two_parts_keeps_every_level_around_and_between_them(site):
    u = wait_upload(site, upload(site, audio(6.0, seed=8))["upload_id"])
    before = grid(site, u["codes"])
    parts = [{"at_sec": 1.0, "end_sec": 2.0}, {"at_sec": 3.5, "end_sec": 4.5}]
    job = generate(site, continue_from={"upload_id": u["upload_id"], "parts": parts}, num_tracks=2, seed=6)
    done = site.wait_job(job["job_id"])
    assert done["status"] == "completed", done
    for t in done["tracks"]:
        g = grid(site, t["files"]["codes"])
        assert g.frames == before.frames  # as long as the upload
        kept = np.ones(before.frames, dtype=bool)
        for p in t["metadata"]["repainted"]["parts"]:
            kept[p["start_frame"] : p["join_frame"]] = False
        assert not kept.all()
        assert np.array_equal(g.codes[:, kept], before.codes[:, kept])
        assert t["metadata"]["repainted"]["origin"] == f"upload/{u['upload_id']}"
    close = [{"at_sec": 1.0, "end_sec": 2.0}, {"at_sec": 2.5, "end_sec": 4.5}]
    r = httpx.post(
        f"{site.url}/generate",
        json={"continue_from": {"upload_id": u["upload_id"], "parts": close}},
        timeout=10,
        verify=TLS,
    )
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == ["body", "continue_from", "parts", 1]


def test_encodings_go_before_queued_tracks_and_a_continuation_waits_for_its_upload(site):
    busy = generate(site, duration=0.1, num_tracks=1)  # holds the one worker
    wait_for(lambda: site.job(busy["job_id"])["tracks"][0]["status"] != "queued", timeout=30)
    queued = generate(site, duration=0.1, num_tracks=1)  # waits for the worker
    u = upload(site, audio(4.0, seed=6))
    waiting = generate(site, continue_from={"upload_id": u["upload_id"]}, duration=0.1, num_tracks=1)
    assert waiting["status"] == "queued"
    assert view(site, u["upload_id"])["status"] == "queued"
    later = site.wait_job(queued["job_id"])
    ready = view(site, u["upload_id"])
    assert ready["status"] == "ready"
    assert ready["finished_at"] < later["started_at"]  # encoded before the track queued before it
    done = site.wait_job(waiting["job_id"])
    assert done["status"] == "completed", done
    kept = grid(site, ready["codes"])
    assert np.array_equal(grid(site, done["tracks"][0]["files"]["codes"]).codes[:, : kept.frames], kept.codes)


def test_a_failed_or_gone_upload_is_refused_before_any_work_and_fails_what_waited(site):
    busy = generate(site, duration=0.1, num_tracks=1)
    wait_for(lambda: site.job(busy["job_id"])["tracks"][0]["status"] != "queued", timeout=30)
    u = upload(site, audio(3.0, seed=7))
    waiting = generate(site, continue_from={"upload_id": u["upload_id"]}, duration=0.1, num_tracks=1)
    (site.tmp / "state" / "results" / "uploads" / u["upload_id"] / "source.wav").unlink()  # lost before it is encoded
    failed = wait_upload(site, u["upload_id"])
    assert failed["status"] == "failed"
    assert failed["error"] == "its file is gone from the results folder"
    done = site.wait_job(waiting["job_id"])
    assert done["status"] == "failed"
    assert "could not be encoded: its file is gone" in done["tracks"][0]["error"]
    r = httpx.post(
        f"{site.url}/generate", json={"continue_from": {"upload_id": u["upload_id"]}}, timeout=10, verify=TLS
    )
    assert r.status_code == 422
    assert r.json()["error"] == (
        f"Field 'continue_from.upload_id': upload {u['upload_id']} could not be encoded: "
        "its file is gone from the results folder."
    )
    assert r.json()["detail"][0]["loc"] == ["body", "continue_from", "upload_id"]
    assert httpx.get(f"{site.url}/uploads/{u['upload_id']}/codes", timeout=10, verify=TLS).status_code == 404


def test_a_deleted_upload_is_gone_everywhere(site):
    u = wait_upload(site, upload(site, audio(2.0, seed=8))["upload_id"])
    r = httpx.delete(f"{site.url}/uploads/{u['upload_id']}", timeout=10, verify=TLS)
    assert r.status_code == 200
    assert r.json()["status"] == "ready"
    assert httpx.get(f"{site.url}/uploads/{u['upload_id']}", timeout=10, verify=TLS).status_code == 404
    assert httpx.get(f"{site.url}/uploads/{u['upload_id']}/codes", timeout=10, verify=TLS).status_code == 404
    assert u["upload_id"] not in stored(site)[0]
    r = httpx.post(
        f"{site.url}/generate", json={"continue_from": {"upload_id": u["upload_id"]}}, timeout=10, verify=TLS
    )
    assert r.status_code == 422
    assert "is not known here" in r.json()["error"]


@pytest.mark.parametrize(
    ("cf", "body", "field", "says"),
    [
        ({"upload_id": "0" * 16}, {}, "continue_from.upload_id", "is not known here"),
        ({"upload_id": "READY", "at_sec": 5.0}, {}, "continue_from.at_sec", "must be inside the upload"),
        ({"upload_id": "READY"}, {"duration": 0.03}, "duration", "end before the upload's kept part"),
        ({"upload_id": "READY", "job_id": "a" * 16, "at_sec": 1.0}, {}, "continue_from", "name either a take"),
        ({"job_id": "a" * 16}, {}, "continue_from", "at_sec is needed to continue a take"),
        ({}, {}, "continue_from", "name either a take"),
    ],
)
def test_a_continuation_that_cannot_be_served_is_refused_naming_the_field(site, cf, body, field, says):
    if "READY" in cf.values():
        ready = wait_upload(site, upload(site, audio(3.0, seed=9))["upload_id"])
        cf = {**cf, "upload_id": ready["upload_id"]}
    r = httpx.post(f"{site.url}/generate", json={"continue_from": cf, **body}, timeout=10, verify=TLS)
    assert r.status_code == 422, r.text
    assert r.json()["error"].startswith(f"Field '{field}'"), r.json()
    assert says in r.json()["error"]


@pytest.mark.process
def test_any_dispatcher_of_a_postgresql_fleet_answers_for_an_upload(tmp_path: Path, pg_url: str):
    from tests.support.pg_fleet import start_dispatcher, stop_all, tone_workers, wait_done

    workers = tone_workers(tmp_path, 1, 0.2)
    a = start_dispatcher(tmp_path, "A", pg_url, workers)
    b = start_dispatcher(tmp_path, "B", pg_url, workers)
    try:
        data = audio(4.0, seed=10)
        r = httpx.post(f"{a.url}/uploads", files={"file": ("x.wav", data, "audio/wav")}, timeout=60, verify=TLS)
        assert r.status_code == 200, r.text
        upload_id = r.json()["upload_id"]
        at_b = wait_for(lambda: (v := _view(b, upload_id))["status"] == "ready" and v, timeout=60)
        got = codes.decode(httpx.get(f"{b.url}{at_b['codes']}", timeout=10, verify=TLS).content)
        assert np.array_equal(got.codes, tone_codes(read_audio(data)[0]))
        body = {"continue_from": {"upload_id": upload_id}, "duration": 0.1, "num_tracks": 1, "tags": "pop"}
        job = httpx.post(f"{b.url}/generate", json=body, timeout=30, verify=TLS).json()
        done = wait_done(a, job["job_id"])
        assert done["status"] == "completed", done
        assert httpx.delete(f"{b.url}/uploads/{upload_id}", timeout=10, verify=TLS).status_code == 200
        assert httpx.get(f"{a.url}/uploads/{upload_id}", timeout=10, verify=TLS).status_code == 404
    finally:
        stop_all(a, b, *workers)


def _view(api: ServerProcess, upload_id: str) -> dict:
    return dict(httpx.get(f"{api.url}/uploads/{upload_id}", timeout=10, verify=TLS).json())


def test_the_workers_encode_route_takes_its_token_its_own_size_cap_and_only_audio(tmp_path: Path):
    w = start_worker(tmp_path, "--pipeline", "test", "--max-audio-mb", "0.5", env={"WORKER_TOKEN": "t0k"}, name="enc")
    try:
        w.wait_healthy()
        auth = {"Authorization": "Bearer t0k"}
        data = audio(2.0)  # 350 kB
        assert httpx.post(f"{w.url}/encode", content=data, timeout=30, verify=TLS).status_code == 401
        r = httpx.post(
            f"{w.url}/encode", params={"task_id": "upload-1"}, content=data, headers=auth, timeout=30, verify=TLS
        )
        assert r.status_code == 200, r.text
        got = r.json()
        assert (got["task_id"], got["grid"]["levels"], got["grid"]["frames"]) == ("upload-1", 64, 2 * 44100 // 2048)
        raw = np.frombuffer(codes_bytes(got["grid"]["codes"]), dtype="<i2").reshape(64, -1)
        assert np.array_equal(raw, tone_codes(read_audio(data)[0]))
        assert got["source"]["format"] == "WAV"
        assert httpx.get(f"{w.url}/tasks/upload-1", headers=auth, timeout=10, verify=TLS).json()["status"] == "done"
        assert httpx.get(f"{w.url}/config", headers=auth, timeout=10, verify=TLS).json()["encoder"] is True
        r = httpx.post(f"{w.url}/encode", content=b"x" * (600 * 1024), headers=auth, timeout=30, verify=TLS)
        assert (r.status_code, r.json()["error"]) == (413, "The audio file is larger than MAX_AUDIO_MB (0.5 MB).")
        r = httpx.post(f"{w.url}/encode", content=b"lyrics, not audio\n" * 40, headers=auth, timeout=30, verify=TLS)
        assert r.status_code == 400
        assert r.json()["error"].startswith("The audio file is not audio that can be read")
    finally:
        w.stop()


def codes_bytes(text: str) -> bytes:
    import base64

    return base64.b64decode(text)


def test_uploads_need_the_api_key_and_a_worker_that_can_encode(tmp_path: Path):
    ref = start_reference_worker(tmp_path)
    ref.wait_healthy()
    port = free_port()
    args = [
        "backend_api.py",
        "--port",
        str(port),
        "--state-dir",
        str(tmp_path / "state"),
        "--health-interval",
        "0.2",
        "--worker-urls",
        ref.url,
        "--api-key",
        "k3y",
    ]
    api = ServerProcess(args, port, tmp_path / "api.log")
    try:
        api.wait_healthy(want=("ok",))
        auth = {"Authorization": "Bearer k3y"}
        wait_for(
            lambda: (
                [w["kind"] for w in httpx.get(f"{api.url}/status", headers=auth, verify=TLS).json()["workers"]]
                == ["reference"]
            )
        )
        files = {"file": ("x.wav", audio(1.0), "audio/wav")}
        assert httpx.post(f"{api.url}/uploads", files=files, timeout=30, verify=TLS).status_code == 401
        r = httpx.post(f"{api.url}/uploads", files=files, headers=auth, timeout=30, verify=TLS)
        assert r.status_code == 503
        assert r.json()["error"].startswith("No worker here can encode audio")
        assert not (tmp_path / "state" / "results" / "uploads").exists()
    finally:
        api.stop()
        ref.stop()
