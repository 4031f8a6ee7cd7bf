"""Whose fault, in process: what the dispatcher accepts as a worker's answer and its files, the breaker
that benches a worker, and a results folder that cannot be written.

The real-process proofs (a misbehaving stand-in worker, a tmpfs that fills) are test_bad_workers.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import shutil
import time
import wave
from pathlib import Path

import httpx
import pytest

from songserve.api.dispatch.pool import WorkerHandle, WorkerPool
from songserve.api.results.result_check import Copied, check_copy, read_wav_header
from songserve.api.workers.client import WorkerClient, WorkerHttp
from songserve.api.workers.outcomes import OutcomeKind, WorkerFault
from songserve.api.workers.to_worker import read_answer, read_batch
from songserve.schemas import ResultFile, WorkerHealth
from tests.support.fake_fleet import FakeFleet, Plan, aio, body, run_job, until
from tests.support.http import TLS
from tests.support.servers import results_files

RESULT = {
    "status": "ok",
    "mp3_filename": "a.mp3",
    "wav_filename": "a.wav",
    "duration_sec": 3.0,
    "backbone_tokens": 1,
    "gpu_id": 0,
    "seed": 1,
}


# ---- a worker's answer ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("code", "answer"),
    [
        (200, {"status": "ok"}),  # a 200 without the fields
        (200, {**RESULT, "wav_filename": 5}),  # wrong types
        (200, {**RESULT, "wav_filename": "../../etc/passwd"}),  # a name /download would never serve
        (200, {"status": "finished"}),  # a word of no contract
        (200, {}),
        (500, {}),  # an error status with nothing to say
    ],
)
def test_an_answer_that_is_not_the_contract_is_the_workers_fault(code, answer):
    with pytest.raises(WorkerFault):
        read_answer(code, answer, reference=False)


def test_errors_said_either_way_stay_errors_of_the_track():
    reference = read_answer(200, {"status": "error", "error": "Traceback …\nRuntimeError: CUDA error"}, True)
    ours = read_answer(500, {"status": "error", "error": "The model failed.", "error_kind": "model"}, False)
    refused = read_answer(400, {}, False)
    assert (reference.kind, reference.error) == (OutcomeKind.error, "RuntimeError: CUDA error")
    assert (ours.kind, ours.error) == (OutcomeKind.error, "The model failed.")
    assert (refused.kind, refused.error) == (OutcomeKind.error, "Worker answered HTTP 400.")


def test_a_batch_answer_of_the_wrong_length_is_the_workers_fault():
    with pytest.raises(WorkerFault, match="1 results for 2 takes"):
        read_batch(200, {"status": "ok", "results": [RESULT]}, 2, reference=False)


def test_a_body_that_is_not_json_is_the_workers_fault():
    with pytest.raises(WorkerFault, match="not JSON"):
        WorkerClient._json(httpx.Response(200, content=b"<html>502</html>"))


# ---- its files --------------------------------------------------------------------------------------
def wav_bytes(seconds: float, rate: int = 8000, channels: int = 2) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"\0\1" * channels * round(seconds * rate))
    return out.getvalue()


def copied(tmp_path: Path, data: bytes) -> Copied:
    path = tmp_path / "x.wav"
    path.write_bytes(data)
    return Copied(path, len(data), hashlib.sha256(data).hexdigest())


def facts(data: bytes) -> ResultFile:
    return ResultFile(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())


def test_a_whole_wav_as_the_worker_described_it_passes(tmp_path):
    data = wav_bytes(2.0)
    check_copy("a.wav", "wav", copied(tmp_path, data), facts(data), 2.0)
    check_copy("a.wav", "wav", copied(tmp_path, data), None, 2.0)  # the reference's worker: no facts
    wav = read_wav_header(tmp_path / "x.wav", len(data), "a.wav")
    assert (wav.channels, wav.sample_rate, wav.frames) == (2, 8000, 16000)


def test_a_wav_cut_with_its_header_rewritten_is_caught_by_its_length(tmp_path):
    short = wav_bytes(1.0)  # self-consistent: RIFF and data sizes agree with the file
    with pytest.raises(WorkerFault, match=r"holds 1\.000s of audio .*said 2\.000s"):
        check_copy("a.wav", "wav", copied(tmp_path, short), facts(short), 2.0)


@pytest.mark.parametrize(
    ("damage", "said_whole", "match"),
    [
        (lambda d: d[: len(d) // 2], True, "bytes; the worker said it wrote"),  # short copy
        (lambda d: d[:-2] + b"\7\7", True, "SHA-256"),  # same length, other bytes
        (lambda d: d[: len(d) // 2], False, "RIFF header says"),  # cut, header not rewritten, no facts
        (lambda d: b"ID3" + d[3:], False, "not a RIFF/WAVE file"),
        (lambda d: b"", False, "empty"),
    ],
)
def test_a_damaged_copy_is_the_workers_fault(tmp_path, damage, said_whole, match):
    whole = wav_bytes(2.0)
    with pytest.raises(WorkerFault, match=match):
        check_copy("a.wav", "wav", copied(tmp_path, damage(whole)), facts(whole) if said_whole else None, 2.0)


# ---- the breaker ------------------------------------------------------------------------------------
def handle(worker_id: int = 0) -> WorkerHandle:
    return WorkerHandle(
        worker_id, WorkerClient(WorkerHttp.shared(httpx.AsyncClient(verify=TLS)), f"http://w{worker_id}.test")
    )


def test_a_worker_is_benched_after_its_faults_then_again_at_once_each_time_for_longer():
    w = handle()
    assert [w.track_failed(True, 3, 60, "garbage") for _ in range(3)] == [False, False, True]
    assert "benched for 60s after 3 failures of its own" in w.degraded_reason
    assert not w.track_failed(True, 3, 60, "garbage")  # work given before the bench counts no more
    w.benched_until = time.monotonic() - 1  # the bench is over: half-open
    assert not w.degraded_reason
    assert w.track_failed(True, 3, 60, "garbage")  # one more failure benches it again, twice as long
    assert "benched for 120s" in w.degraded_reason
    for expected in (240, 480, 480):  # up to MAX_BENCH_FACTOR × BENCH_SEC
        w.benched_until = time.monotonic() - 1
        w.track_failed(True, 3, 60, "garbage")
        assert f"benched for {expected}s" in w.degraded_reason
    w.benched_until = time.monotonic() - 1
    w.track_succeeded()  # a finished track closes the breaker
    assert [w.track_failed(True, 3, 60, "garbage") for _ in range(3)] == [False, False, True]
    assert "benched for 60s" in w.degraded_reason


def test_a_worker_with_recent_faults_is_offered_after_the_healthy_ones():
    async def check() -> None:
        async def nothing(w: WorkerHandle, before: object) -> None:
            pass

        pool = WorkerPool(WorkerHttp.shared(httpx.AsyncClient(verify=TLS)), 1.0, 2, nothing)
        pool.sync([])
        for i in range(3):
            w = pool._by_id[i] = handle(i)
            w.online, w.leased, w.health = True, True, WorkerHealth(status="idle", task_id=None)
            w.lease_epoch, w.lease_valid_until = 1, time.monotonic() + 60  # a lease renewed just now
        pool._by_id[0].track_failed(True, 3, 60, "garbage")
        assert [w.worker_id for w in pool.available()] == [1, 2, 0]
        pool._by_id[0].collecting = 2  # its copies lag: no new track
        assert [w.worker_id for w in pool.available()] == [1, 2]

    asyncio.run(check())


# ---- through the dispatcher ----------------------------------------------------------------------------
@aio
async def test_a_garbage_answer_costs_the_track_no_attempt_and_charges_its_worker(tmp_path):
    async with FakeFleet(tmp_path, n=2, max_attempts=1) as f:
        f.workers[0].plans.append(Plan("garbage"))
        view = await run_job(f)
        assert view.status == "completed"
        assert view.tracks[0].attempts == 1
        assert view.tracks[0].metadata["worker_id"] == 1
        assert f.svc.dispatcher.pool.workers[0].faults == 1
        assert 'songserve_worker_faults_total{worker="0"} 1.0' in f.parts.readings.metrics().decode()


@aio
async def test_a_dripping_download_is_abandoned_at_its_deadline_and_charged(tmp_path):
    async with FakeFleet(tmp_path, n=2, download_timeout_sec=0.3) as f:
        f.workers[0].drip = True
        view = await run_job(f)
        assert view.status == "completed"
        assert view.tracks[0].metadata["worker_id"] == 1
        assert view.tracks[0].attempts == 1
        assert f.svc.dispatcher.pool.workers[0].faults == 1
        assert not results_files(f.svc.artifacts.root, "*.tmp")


@aio
async def test_a_cancel_stops_a_download_in_progress(tmp_path):
    async with FakeFleet(tmp_path, n=1) as f:
        f.workers[0].drip = True  # the copy would take until DOWNLOAD_TIMEOUT_SEC (45 s)
        job_id = (await f.svc.submit(body())).job_id
        await until(lambda: any(a.collecting for a in f.svc.dispatcher.attempts.running.values()))
        await f.svc.cancel(job_id)
        await until(lambda: f.holds(job_id, lambda v: v.tracks[0].status == "cancelled"))  # the view: at once
        await until(lambda: not f.svc.dispatcher.attempts.running)  # the copy stops (not after the 45 s drip)
        assert not results_files(f.svc.artifacts.root, "*")  # nothing of the copy stayed
        assert f.svc.dispatcher.pool.workers[0].faults == 0  # a cancel is nobody's fault


@aio
async def test_a_results_folder_that_cannot_be_written_holds_the_track_and_resumes_by_itself(tmp_path):
    async with FakeFleet(tmp_path, n=1) as f:
        results = f.svc.artifacts.root
        await until(lambda: f.svc.dispatcher.results._probed_at > 0)  # the start's probe passed: a copy finds it
        release = asyncio.Event()
        f.workers[0].plans.append(Plan(release=release))  # the take runs until the folder is broken
        job_id = (await f.svc.submit(body())).job_id
        await until(lambda: bool(f.workers[0].generated))
        shutil.rmtree(results)
        results.write_text("not a folder")  # every write under it fails (NotADirectoryError), even as root
        release.set()
        # The probe runs on a thread of its own: one may have looked between the removal and the file
        # ("No such file"); the next one names what is there now.
        await until(lambda: not f.parts.readings.ready()[0] and "Not a directory" in f.parts.readings.ready()[1])
        assert str(results) in f.parts.readings.ready()[1]
        await until(lambda: f.svc.dispatcher.pool.workers[0].view.value == "idle")  # generated, then released
        view = await f.svc.view(job_id)
        assert view.tracks[0].status == "generating"  # held: not failed, not retried
        second = (await f.svc.submit(body())).job_id
        assert (await f.svc.view(second)).tracks[0].status == "queued"  # nothing new starts meanwhile
        results.unlink()
        results.mkdir()  # writable again: the probe notices, the held track is copied, the queue moves
        for j in (job_id, second):
            await until(lambda j=j: f.holds(j, lambda v: v.status == "completed"), timeout=20)
        assert len(f.workers[0].generated) == 2  # nothing generated twice
        assert (await f.svc.view(job_id)).tracks[0].attempts == 1
        assert f.parts.readings.ready()[0]


@aio
async def test_a_held_track_that_is_cancelled_ends_cancelled(tmp_path):
    async with FakeFleet(tmp_path, n=1) as f:
        results = f.svc.artifacts.root
        shutil.rmtree(results)
        results.write_text("not a folder")
        job_id = (await f.svc.submit(body())).job_id
        await until(lambda: not f.parts.readings.ready()[0])
        await f.svc.cancel(job_id)
        await until(lambda: f.holds(job_id, lambda v: v.tracks[0].status == "cancelled"))
        assert (await f.svc.view(job_id)).status == "cancelled"
