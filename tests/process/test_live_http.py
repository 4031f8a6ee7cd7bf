"""Live audio through a real dispatcher and real tone workers, over HTTP.

A tone worker's live audio is its tone itself, written in step with its backbone phase (the first
third of ``--test-delay-s``), so the relay's contract is checked here at tone speed and exactly:
the streamed PCM is the final WAV's PCM. The model's preview is ``test_live_model.py``.
"""

from __future__ import annotations

import io
import struct
import threading
import time

import httpx
import numpy as np
import pytest
import soundfile as sf

from tests.support.http import TLS
from tests.support.pg_fleet import start_dispatcher, stop_all, tone_workers
from tests.support.servers import Cluster, cluster_of, start_reference_worker, start_worker, wait_for

SECONDS = 12.0  # of audio per take
BODY = {"tags": "pop", "lyrics": "[verse]\nla la", "duration": SECONDS / 60, "num_tracks": 1}


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("live"), workers=1, delay=3.0, threads=True)
    yield c
    c.stop()


def submit(site: Cluster, **body) -> str:
    r = httpx.post(f"{site.url}/generate", json={**BODY, **body}, timeout=10, verify=TLS)
    assert r.status_code == 200, r.text
    return str(r.json()["job_id"])


class Listener:
    """Reads a stream in a thread, noting when each piece came and the track's status at that moment."""

    def __init__(self, url: str, job_url: str | None = None, read_slowly: float = 0.0) -> None:
        self.url, self.job_url, self.slow = url, job_url, read_slowly
        self.body = bytearray()
        self.statuses: list[str] = []  # the track's status when each piece with audio in it arrived
        self.error: BaseException | None = None
        self.status_code = 0
        self.headers: dict[str, str] = {}
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with httpx.stream("GET", self.url, timeout=httpx.Timeout(10, read=60), verify=TLS) as r:
                self.status_code, self.headers = r.status_code, dict(r.headers)
                for piece in r.iter_raw(1 << 14):
                    self.body += piece
                    if self.job_url and len(self.body) > 44:  # past a WAV header: audio
                        self.statuses.append(
                            httpx.get(self.job_url, timeout=10, verify=TLS).json()["tracks"][0]["status"]
                        )
                    if self.slow:
                        time.sleep(self.slow)
        except BaseException as exc:
            self.error = exc

    def join(self, timeout: float = 60) -> Listener:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the stream did not end"
        return self


def final_wav(site: Cluster, job_id: str) -> tuple[np.ndarray, bytes]:
    wav = httpx.get(f"{site.url}/job/{job_id}/track/0/wav", timeout=10, verify=TLS).content
    pcm, _ = sf.read(io.BytesIO(wav), dtype="int16")
    return pcm, wav


def test_a_wav_stream_opened_while_queued_is_the_take_from_its_start_to_its_end(site):
    job = submit(site, seed=5)
    url = f"{site.url}/job/{job}/track/0/stream?format=wav"
    heard = Listener(url, f"{site.url}/job/{job}").join()
    assert heard.error is None
    assert heard.status_code == 200
    assert heard.headers["content-type"] == "audio/wav"
    head = bytes(heard.body[:44])
    assert head[:4] == b"RIFF"
    assert head[8:16] == b"WAVEfmt "
    assert head[36:40] == b"data"
    assert struct.unpack("<I", head[4:8])[0] == struct.unpack("<I", head[40:44])[0] == 0xFFFFFFFF  # length unknown
    assert struct.unpack("<HHI", head[20:28]) == (1, 2, 44_100)
    assert "generating" in heard.statuses  # audio came while the track was still being made
    final, _ = final_wav(site, job)
    streamed = np.frombuffer(bytes(heard.body[44:]), dtype="<i2").reshape(-1, 2)
    assert np.array_equal(streamed, final)  # a tone's live audio is its final audio: every sample, once


def test_an_mp3_stream_decodes_to_the_takes_length_and_the_view_says_how_far_it_is(site):
    job = submit(site, seed=6)
    url = f"{site.url}/job/{job}/track/0/stream"
    heard = Listener(url)
    views = []
    while heard.thread.is_alive():
        views.append(httpx.get(f"{site.url}/job/{job}", timeout=10, verify=TLS).json()["tracks"][0])
        time.sleep(0.1)
    heard.join()
    assert heard.error is None
    assert heard.headers["content-type"] == "audio/mpeg"
    audio, rate = sf.read(io.BytesIO(bytes(heard.body)), dtype="int16")
    final, _ = final_wav(site, job)
    assert rate == 44_100
    assert abs(len(audio) - len(final)) < 3 * 1152  # an encoder's priming and padding, no gapless header
    live = [v["preview_sec"] for v in views if v["status"] == "generating"]
    assert any(0 < s < SECONDS for s in live), live  # part of it playable while generating
    assert all(v["stream_url"] == f"/job/{job}/track/0/stream" for v in views)


def test_a_done_tracks_stream_is_its_final_file(site):
    job = submit(site, seed=7)
    site.wait_job(job)
    r = httpx.get(f"{site.url}/job/{job}/track/0/stream", params={"format": "wav"}, timeout=10, verify=TLS)
    assert r.status_code == 200
    assert r.content == final_wav(site, job)[1]


def test_a_cancel_cuts_the_stream_and_a_cancelled_tracks_stream_is_a_409(site):
    job = submit(site, seed=8)
    heard = Listener(f"{site.url}/job/{job}/track/0/stream?format=wav")
    wait_for(lambda: len(heard.body) > 44 + 4 * 44_100, timeout=30)  # a second of audio heard
    assert httpx.delete(f"{site.url}/job/{job}", timeout=10, verify=TLS).status_code == 200
    heard.join()
    assert isinstance(heard.error, httpx.RemoteProtocolError)  # cut: the transfer ended incomplete
    r = httpx.get(f"{site.url}/job/{job}/track/0/stream", timeout=10, verify=TLS)
    assert r.status_code == 409
    assert "cancelled" in r.json()["error"]


def test_bad_requests_name_what_is_wrong(site):
    job = submit(site, seed=9)
    head = httpx.head(f"{site.url}/job/{job}/track/0/stream", timeout=10, verify=TLS)  # what GET answers, no body
    assert (head.status_code, head.headers["content-type"], head.content) == (200, "audio/mpeg", b"")
    r = httpx.get(f"{site.url}/job/{job}/track/0/stream", params={"format": "ogg"}, timeout=10, verify=TLS)
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["query", "format"]
    assert httpx.get(f"{site.url}/job/{job}/track/3/stream", timeout=10, verify=TLS).status_code == 400
    assert httpx.get(f"{site.url}/job/0123456789abcdef/track/0/stream", timeout=10, verify=TLS).status_code == 404
    # the take itself is not needed: cancelled, so the next test's take finds the worker idle without
    # waiting out its 3 s
    httpx.delete(f"{site.url}/job/{job}", timeout=10, verify=TLS)
    site.wait_job(job)


def test_a_listener_that_stops_reading_does_not_hold_the_take_back(site):
    job = submit(site, seed=10)
    with httpx.stream("GET", f"{site.url}/job/{job}/track/0/stream?format=wav", timeout=30, verify=TLS) as r:
        next(r.iter_raw(64))  # the header, then nothing more is read
        done = site.wait_job(job, timeout=30)
        assert done["status"] == "completed"
        assert done["tracks"][0]["metadata"]["live"]["state"] == "complete"


def test_the_request_can_ask_for_live_audio_before_anyone_listens(site):
    job = submit(site, seed=11, preview=True)
    wait_for(
        lambda: httpx.get(f"{site.url}/job/{job}", timeout=10, verify=TLS).json()["tracks"][0]["preview_sec"] > 0,
        timeout=30,
    )
    done = site.wait_job(job)
    assert done["tracks"][0]["metadata"]["live"] == {"state": "complete", "seconds": pytest.approx(SECONDS, abs=0.1)}
    assert done["tracks"][0]["preview_sec"] == 0  # done: the final audio is what there is


def test_a_track_on_a_reference_worker_streams_its_final_audio_when_done(tmp_path):
    ref = start_reference_worker(tmp_path, delay=1.0)
    site = cluster_of(tmp_path, [ref])
    try:
        job = submit(site, duration=1.0)
        heard = Listener(f"{site.url}/job/{job}/track/0/stream?format=wav").join()
        assert heard.error is None
        final, _ = final_wav(site, job)
        assert np.array_equal(np.frombuffer(bytes(heard.body[44:]), dtype="<i2").reshape(-1, 2), final)
    finally:
        site.stop()


def test_a_listener_who_asks_before_the_take_reaches_its_worker_hears_it_live(tmp_path):
    """The dispatcher marks the track generating before its request reaches the worker (held 1.5 s here,
    tests/support/late_worker.py): the relay asks a worker that does not know the task yet, and asks again."""
    late = start_worker(
        tmp_path,
        "--pipeline",
        "test",
        "--test-delay-s",
        "3",
        name="late",
        script="tests/support/late_worker.py",
        env={"SONGSERVE_LATE_SEC": "1.5"},
    )
    site = cluster_of(tmp_path, [late])
    try:
        job = submit(site, seed=13)
        wait_for(lambda: site.job(job)["tracks"][0]["status"] == "generating", timeout=30, interval=0.02)
        heard = Listener(f"{site.url}/job/{job}/track/0/stream?format=wav", f"{site.url}/job/{job}").join()
        assert heard.error is None
        assert "generating" in heard.statuses  # live, not the final file after the take
        final, _ = final_wav(site, job)
        assert np.array_equal(np.frombuffer(bytes(heard.body[44:]), dtype="<i2").reshape(-1, 2), final)
        assert "does not know task" in (tmp_path / "api.log").read_text()  # the gap was there, and asked across
    finally:
        site.stop()


def test_a_stream_opened_at_the_other_dispatcher_of_a_postgresql_pair_plays(tmp_path, pg_url):
    """Submitted at A, streamed at B: B follows the track in the store and relays whichever worker runs it."""
    workers = tone_workers(tmp_path, 2, 3.0)
    a = start_dispatcher(tmp_path, "A", pg_url, workers)
    b = start_dispatcher(tmp_path, "B", pg_url, workers)
    try:
        r = httpx.post(a.url + "/generate", json={**BODY, "seed": 12}, timeout=10, verify=TLS)
        assert r.status_code == 200, r.text
        job_id = r.json()["job_id"]
        heard = Listener(f"{b.url}/job/{job_id}/track/0/stream?format=wav", f"{a.url}/job/{job_id}").join()
        assert heard.error is None
        assert "generating" in heard.statuses
        wav = httpx.get(f"{b.url}/job/{job_id}/track/0/wav", timeout=10, verify=TLS).content
        final, _ = sf.read(io.BytesIO(wav), dtype="int16")
        assert np.array_equal(np.frombuffer(bytes(heard.body[44:]), dtype="<i2").reshape(-1, 2), final)
    finally:
        stop_all(a, b, *workers)
