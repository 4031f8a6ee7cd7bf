"""Workers report their output disk, say "disk full" when it is the disk, and remove their own files.

Real worker processes (test pipeline: a tone, the real export) over real HTTP; a small full tmpfs
where mounting is allowed (root on Linux); in-process fault injection for the rest.
"""

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest

from songserve.errors import NotFoundError, RequestError, TaskError
from songserve.pipeline.context import TaskContext
from songserve.pipeline.stages import export
from songserve.pipeline.stages.export import ExportError, Mp3Options, write_track
from songserve.pipeline.testing.tone import TonePipeline
from songserve.pipeline.types import TrackRequest, TrackResult
from songserve.process.settings import load_settings
from songserve.schemas import ErrorKind, TaskState, WorkerGenerateRequest
from songserve.worker.device import ToneDevice
from songserve.worker.failures import classify_failure
from songserve.worker.outputs import sweep_outputs
from songserve.worker.runtime import WorkerRuntime
from songserve.worker.settings import WorkerSettings
from songserve.worker.tasks import TaskRegistry
from tests.support.http import TLS
from tests.support.servers import mount_tmpfs, start_worker, wait_for

TOKEN = "disk-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _generate(url: str, headers: dict | None = None, **body) -> httpx.Response:
    payload = {"lyrics": "hello", "tags": "pop", "duration": 0.02, "task_id": uuid.uuid4().hex[:12], **body}
    return httpx.post(url + "/generate", json=payload, headers=headers, timeout=60, verify=TLS)


def _health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=10, verify=TLS).json()


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("disk")
    w = start_worker(tmp, "--pipeline", "test", "--output-ttl-sec", "0", env={"WORKER_TOKEN": TOKEN})
    w.wait_healthy()
    w.out_dir = tmp / "worker_audio"  # type: ignore[attr-defined]
    yield w
    w.stop()


# -- real processes ---------------------------------------------------------------------------------


def test_health_reports_the_disk_and_files(worker) -> None:
    before = _health(worker.url)
    assert before["disk_free_mb"] > 0
    assert before["disk_low"] is False
    r = _generate(worker.url, AUTH)
    assert r.status_code == 200, r.text
    after = _health(worker.url)
    assert after["output_files"] == before["output_files"] + 4  # WAV, MP3, JSON and the codes grid


def test_delete_files_removes_one_task_and_is_protected(worker) -> None:
    keep = _generate(worker.url, AUTH).json()
    done = _generate(worker.url, AUTH).json()
    names = {done[k] for k in ("wav_filename", "mp3_filename", "json_filename", "codes_filename")}
    assert httpx.delete(f"{worker.url}/files/{done['task_id']}", timeout=10, verify=TLS).status_code == 401
    r = httpx.delete(f"{worker.url}/files/{done['task_id']}", headers=AUTH, timeout=10, verify=TLS)
    assert r.status_code == 200, r.text
    assert set(r.json()["removed"]) == names
    on_disk = set(os.listdir(worker.out_dir))
    assert not names & on_disk
    assert keep["wav_filename"] in on_disk
    assert keep["json_filename"] in on_disk
    r = httpx.get(f"{worker.url}/download/{done['wav_filename']}", headers=AUTH, timeout=10, verify=TLS)
    assert r.status_code == 404
    again = httpx.delete(f"{worker.url}/files/{done['task_id']}", headers=AUTH, timeout=10, verify=TLS)
    assert again.status_code == 200
    assert again.json()["removed"] == []
    unknown = httpx.delete(f"{worker.url}/files/never-ran", headers=AUTH, timeout=10, verify=TLS)
    assert unknown.status_code == 404
    assert unknown.json()["status"] == "error"
    bad = httpx.delete(f"{worker.url}/files/..%2F..%2Fetc", headers=AUTH, timeout=10, verify=TLS)
    assert bad.status_code == 404


def test_low_disk_is_reported(tmp_path: Path) -> None:
    w = start_worker(tmp_path, "--pipeline", "test", "--min-free-disk-mb", str(10**12))
    try:
        h = w.wait_healthy()
        assert h["disk_low"] is True
        assert h["disk_free_mb"] < 10**12
    finally:
        w.stop()


def test_old_output_files_are_swept(tmp_path: Path) -> None:
    w = start_worker(tmp_path, "--pipeline", "test", "--output-ttl-sec", "1")
    try:
        w.wait_healthy()
        out = tmp_path / "worker_audio"
        out.mkdir(exist_ok=True)
        (out / "notes.txt").write_text("not ours")
        r = _generate(w.url)
        assert r.status_code == 200, r.text
        assert (out / r.json()["wav_filename"]).exists() or _health(w.url)["output_files"] >= 1
        wait_for(lambda: _health(w.url)["output_files"] == 1, timeout=30, interval=0.2)
        assert os.listdir(out) == ["notes.txt"]
    finally:
        w.stop()


@pytest.mark.process
def test_full_output_disk_is_named_and_leaves_no_files(tmp_path: Path) -> None:
    mnt = tmp_path / "small"
    reason = mount_tmpfs(mnt, "2m")
    if reason:
        print(f"skipped: {reason}")
        pytest.skip(reason)
    w = None
    try:
        out = mnt / "generated_audio"
        out.mkdir()
        free = os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize
        (mnt / "filler").write_bytes(b"\0" * (free - 200_000))  # ~200 kB left: a 3 s WAV (~530 kB) cannot fit
        w = start_worker(tmp_path, "--pipeline", "test", "--output-dir", str(out), "--min-free-disk-mb", "1")
        h = w.wait_healthy()
        assert h["disk_low"] is True
        assert h["disk_free_mb"] < 1
        r = _generate(w.url, duration=0.05)
        assert r.status_code == 500, r.text
        body = r.json()
        assert body["error_kind"] == "environment"
        assert body["error"] == "The worker's output disk is full (…/generated_audio)."
        assert str(mnt) not in body["error"]  # the full path stays in the worker's log
        assert str(out) in w.log_tail(20000)
        assert "LibsndfileError" not in body["error"]
        assert "model" not in body["error"]
        task = httpx.get(f"{w.url}/tasks/{body['task_id']}", timeout=10, verify=TLS).json()
        assert task["status"] == "error"
        assert task["error_kind"] == "environment"
        assert os.listdir(out) == []  # neither temporary nor finished files are left behind
        assert _health(w.url)["status"] == "idle"
        (mnt / "filler").unlink()  # space returns: the same worker succeeds
        assert _generate(w.url, duration=0.05).status_code == 200
    finally:
        if w is not None:
            w.stop()
        subprocess.run(["umount", str(mnt)], check=False)


# -- in process -------------------------------------------------------------------------------------


class _Failing(TonePipeline):
    def __init__(self, s: WorkerSettings, exc: BaseException) -> None:
        super().__init__(s)
        self.exc = exc

    def run(self, req: TrackRequest, ctx: TaskContext) -> TrackResult:
        raise self.exc


def _runtime(tmp_path: Path, exc: BaseException) -> WorkerRuntime:
    s = load_settings(WorkerSettings, [], pipeline="test", output_dir=tmp_path / "out")
    rt = WorkerRuntime(s, _Failing(s, exc), ToneDevice())
    rt.status = rt.status.idle
    return rt


@pytest.mark.parametrize(
    ("exc", "kind", "words"),
    [
        (OSError(errno.ENOSPC, "No space left on device"), ErrorKind.environment, "output disk is full"),
        (MemoryError(), ErrorKind.environment, "ran out of memory"),
        (ValueError("shape mismatch"), ErrorKind.model, "failed inside the model (ValueError)"),
    ],
)
def test_injected_failures_are_classified(tmp_path: Path, exc: BaseException, kind: ErrorKind, words: str) -> None:
    rt = _runtime(tmp_path, exc)
    with pytest.raises(TaskError) as info:
        asyncio.run(rt.generate(WorkerGenerateRequest(task_id="t1", duration=0.01)))
    assert words in str(info.value)
    assert info.value.kind is kind
    view = rt.task("t1")
    assert view.status is TaskState.error
    assert view.error_kind is kind
    assert words in (view.error or "")
    assert rt.status.value == "idle"
    rt.shutdown()


def test_torch_out_of_memory_on_the_model_device_is_the_environment(tmp_path: Path) -> None:
    """torch's own error says out of memory by its type; its text need not (the device knows the type)."""
    import torch

    from songserve.worker.torch_device import TorchDevice

    exc = torch.OutOfMemoryError("Tried to allocate 2.00 GiB")
    s = load_settings(WorkerSettings, [], pipeline="test", output_dir=tmp_path / "out")
    rt = WorkerRuntime(s, _Failing(s, exc), TorchDevice(torch.device("cpu"), threads=1))
    rt.status = rt.status.idle
    with pytest.raises(TaskError) as info:
        asyncio.run(rt.generate(WorkerGenerateRequest(task_id="t1", duration=0.01)))
    assert str(info.value) == "The worker ran out of memory."
    assert info.value.kind is ErrorKind.environment
    rt.shutdown()


def test_enospc_sentence_names_the_output_folder(tmp_path: Path) -> None:
    kind, text = classify_failure(OSError(errno.ENOSPC, "No space left on device"), tmp_path / "generated_audio")
    assert kind is ErrorKind.environment
    assert text == "The worker's output disk is full (…/generated_audio)."
    kind, text = classify_failure(OSError(errno.EROFS, "Read-only file system", str(tmp_path / "x")), tmp_path)
    assert kind is ErrorKind.environment
    assert "could not write its output files" in text
    assert "Read-only" in text


def test_export_failure_on_full_disk_removes_written_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """libsndfile fails the MP3 with no errno; the disk is measured and the WAV already written removed."""

    def write_mp3(path, *args, **kw):  # the MP3 is written in blocks (export._write_mp3); it fails after the WAV
        Path(path).write_bytes(b"partial")
        raise RuntimeError("Error opening file: System error.")  # what LibsndfileError looks like

    monkeypatch.setattr(export, "_write_mp3", write_mp3)
    monkeypatch.setattr(export.shutil, "disk_usage", lambda p: _Usage(free=1000))
    audio = np.zeros((44100, 2), np.float32)
    with pytest.raises(ExportError) as info:
        write_track(tmp_path, audio, 44100, {}, Mp3Options())
    assert info.value.errno == errno.ENOSPC
    assert "No space left" in str(info.value)
    assert os.listdir(tmp_path) == []


def test_export_write_error_with_space_is_a_write_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def write(path, *a, **kw):
        raise RuntimeError("unsupported sample format")

    monkeypatch.setattr(export.sf, "write", write)
    with pytest.raises(ExportError) as info:
        write_track(tmp_path, np.zeros((4410, 2), np.float32), 44100, {}, Mp3Options())
    assert info.value.errno == errno.EIO
    assert "unsupported sample format" in str(info.value)
    kind, text = classify_failure(info.value, tmp_path)
    assert kind is ErrorKind.environment
    assert f"in …/{tmp_path.name} (" in text
    assert os.listdir(tmp_path) == []


class _Usage:
    def __init__(self, free: int) -> None:
        self.free, self.total, self.used = free, 10**9, 10**9 - free


def test_sweep_removes_only_old_export_files(tmp_path: Path) -> None:
    for name in ("a.wav", "a.mp3", "a.json", ".a.wav.123abc.tmp", "keep.txt", "new.wav"):
        (tmp_path / name).write_bytes(b"x")
    os.symlink(tmp_path / "keep.txt", tmp_path / "link.wav")
    old = 1_000_000.0
    for name in ("a.wav", "a.mp3", "a.json", ".a.wav.123abc.tmp", "keep.txt"):
        os.utime(tmp_path / name, (old, old))
    assert sweep_outputs(tmp_path, ttl_sec=3600, now=old + 7200) == 4
    assert sorted(os.listdir(tmp_path)) == ["keep.txt", "link.wav", "new.wav"]


def test_files_of_a_forgotten_task_are_found_by_their_json(tmp_path: Path) -> None:
    """After a restart the worker no longer remembers the task: its JSON still names the files."""
    s = load_settings(WorkerSettings, [], pipeline="test", output_dir=tmp_path / "out")
    rt = WorkerRuntime(s, TonePipeline(s), ToneDevice())
    rt.status = rt.status.idle
    other = asyncio.run(rt.generate(WorkerGenerateRequest(task_id="other", duration=0.01)))
    done = asyncio.run(rt.generate(WorkerGenerateRequest(task_id="gone", duration=0.01)))
    rt.tasks = TaskRegistry()  # what a restart forgets
    removed = rt.remove_task_files("gone")
    assert sorted(removed) == sorted([done.wav_filename, done.mp3_filename, done.json_filename, done.codes_filename])
    assert sorted(os.listdir(s.output_dir)) == sorted(
        [other.wav_filename, other.mp3_filename, other.json_filename, other.codes_filename]
    )
    with pytest.raises(NotFoundError):
        rt.remove_task_files("never-ran")
    rt.tasks.batch = [TaskContext("running")]
    with pytest.raises(RequestError, match="still running"):
        rt.remove_task_files("running")
    rt.tasks.batch = []
    rt.shutdown()
