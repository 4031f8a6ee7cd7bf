"""ACE-Step's dialect through a real dispatcher process on ``--acestep-port``, over real workers.

The dispatcher serves both dialects from one process: a task released on the ACE-Step port is a job
on ours. Tone workers (``--pipeline test``) write a sine of 220 + seed % 440 Hz for the asked length,
so a downloaded take shows both its length and the seed it was made with. The reference worker's
stand-in logs every request it receives, so the mapping tests see what reached a worker (it has no
seed field: the seeds are proven by the tones).
"""

from __future__ import annotations

import io
import json
from urllib.parse import urljoin

import httpx
import numpy as np
import psutil
import pytest
import soundfile as sf

from tests.support.http import TLS
from tests.support.servers import Cluster, ServerProcess, cluster_of, free_port, start_reference_worker, wait_for

ERROR_KEYS = {"status", "detail", "data", "code", "error", "timestamp", "extra"}


class AceStepClient:
    """A client that knows only ACE-Step's API and a base URL, as its wrappers are written."""

    def __init__(self, base: str) -> None:
        self.base = base

    def release(self, **params: object) -> str:
        answer = httpx.post(self.base + "/release_task", json=params, timeout=10, verify=TLS).json()
        assert answer["code"] == 200, answer
        return str(answer["data"]["task_id"])

    def poll(self, task_id: str) -> dict:
        # ACE-Step's docs send task_id_list as a string holding a JSON array.
        body = {"task_id_list": json.dumps([task_id])}
        answer = httpx.post(self.base + "/query_result", json=body, timeout=10, verify=TLS).json()
        assert answer["code"] == 200, answer
        return answer["data"][0]

    def wait(self, task_id: str, timeout: float = 90) -> list[dict]:
        item = wait_for(lambda: (i := self.poll(task_id))["status"] != 0 and i, timeout=timeout, interval=0.2)
        assert item["status"] == 1, item
        return json.loads(item["result"])

    def download(self, take: dict) -> httpx.Response:
        return httpx.get(urljoin(self.base + "/", take["file"]), timeout=10, verify=TLS)


def tone_hz(audio: np.ndarray, rate: int) -> float:
    mono = audio.mean(axis=1) if audio.ndim > 1 else audio
    spectrum = np.abs(np.fft.rfft(mono))
    return float(np.fft.rfftfreq(len(mono), 1 / rate)[int(np.argmax(spectrum))])


def listening_ports(proc: ServerProcess) -> set[int]:
    conns = psutil.Process(proc.proc.pid).net_connections(kind="tcp")
    return {c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN}


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    port = free_port()
    c = Cluster(tmp_path_factory.mktemp("acestep"), workers=2, delay=0.2, api_args=("--acestep-port", str(port)))
    c.ace = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(site) -> AceStepClient:
    return AceStepClient(site.ace)


@pytest.fixture(scope="module")
def finished(client) -> tuple[str, list[dict]]:
    """One finished WAV take (batch of one, 3 s)."""
    task_id = client.release(prompt="piano", audio_duration=3, batch_size=1, audio_format="wav")
    return task_id, client.wait(task_id)


def test_a_client_written_for_acestep_gets_playable_mp3s_of_the_asked_length_with_its_seeds(site, client):
    task_id = client.release(
        caption="pop, piano",
        lyrics="[verse]\nhello。world",
        audio_duration=5,
        batch_size=2,
        use_random_seed=False,
        seed=11,
        thinking=True,
    )
    takes = client.wait(task_id)
    assert len(takes) == 2
    for i, take in enumerate(takes):
        got = client.download(take)
        assert got.status_code == 200
        assert got.headers["content-type"] == "audio/mpeg"
        audio, rate = sf.read(io.BytesIO(got.content), always_2d=True)
        assert abs(len(audio) / rate - 5.0) < 0.1  # the asked length
        assert abs(tone_hz(audio, rate) - (220 + (11 + i) % 440)) < 0.5  # made with seed 11 + i
        assert (take["seed_value"], take["seed"]) == ("11,12", 11 + i)
        assert abs(take["metas"]["duration"] - 5.0) < 0.1
        assert (take["prompt"], take["lyrics"]) == ("Pop, Piano", "[verse]\nhello.world")
    # A task is a job: our own port shows it, with the same seeds.
    job = site.job(task_id)
    assert job["status"] == "completed"
    assert [t["seed"] for t in job["tracks"]] == [11, 12]


def _encoded(kind: str, fields: dict[str, str]) -> dict:
    """The httpx arguments that send ``fields`` in one of the encodings ACE-Step reads."""
    if kind == "plus_json":
        return {"content": json.dumps(fields), "headers": {"Content-Type": "application/vnd.api+json"}}
    if kind == "untyped_json":
        return {"content": json.dumps(fields)}
    if kind == "form":
        return {"data": fields}
    return {"data": fields, "files": {"src_audio": ("take.mp3", b"\xff\xfb\x90\x00" * 64, "audio/mpeg")}}


@pytest.mark.parametrize("kind", ["form", "multipart", "plus_json", "untyped_json"])
def test_every_body_encoding_with_aliases_and_nested_sources_makes_the_same_job(site, client, kind):
    fields = {
        "caption": "Pop, Piano",
        "lyrics": "[verse]\nla la",
        "targetDuration": "3",
        "batch_size": "2",
        "useRandomSeed": "false",
        "seed": "21",
        "thinking": "true",
        "param_obj": json.dumps({"bpm": 100}),
        "metas": json.dumps({"keyscale": "C major"}),
    }
    r = httpx.post(site.ace + "/release_task", timeout=10, **_encoded(kind, fields), verify=TLS)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["code"] == 200
    ignored = {"thinking", "param_obj.bpm", "metas.keyscale"} | ({"src_audio"} if kind == "multipart" else set())
    assert set(answer["extra"]["ignored"]) == ignored
    assert answer["extra"]["prompt_mode"] == "tags"
    task_id = answer["data"]["task_id"]
    assert [t["seed"] for t in site.job(task_id)["tracks"]] == [21, 22]
    takes = client.wait(task_id)
    assert [t["seed"] for t in takes] == [21, 22]
    assert all(abs(t["metas"]["duration"] - 3.0) < 0.1 for t in takes)


def test_wav_and_flac_are_served_with_their_types_and_ranges(site, client, finished):
    task_id, takes = finished
    got = client.download(takes[0])
    assert (got.status_code, got.headers["content-type"]) == (200, "audio/wav")
    assert abs(sf.info(io.BytesIO(got.content)).duration - 3.0) < 0.05
    # 2 s is under MIN_DURATION (0.05 min): read as 3 s, and the answer says so.
    r = httpx.post(
        site.ace + "/release_task", json={"audio_duration": 2, "batch_size": 1, "audio_format": "FLAC"}, verify=TLS
    )
    assert r.json()["extra"]["adjusted"] == {"audio_duration": {"from": 2.0, "to": 3.0}}
    flac_id = r.json()["data"]["task_id"]
    flac = client.wait(flac_id)[0]
    assert flac["file"] == f"/v1/audio?path={flac_id}-0.flac"
    whole = client.download(flac)
    assert (whole.status_code, whole.headers["content-type"]) == (200, "audio/flac")
    info = sf.info(io.BytesIO(whole.content))
    assert (info.format, round(info.duration, 1)) == ("FLAC", 3.0)
    part = httpx.get(site.ace + flac["file"], headers={"Range": "bytes=0-99"}, verify=TLS)
    assert part.status_code == 206
    assert part.content == whole.content[:100]
    assert part.headers["content-range"] == f"bytes 0-99/{len(whole.content)}"
    # The same job's MP3 on our own port.
    assert httpx.get(f"{site.url}/job/{flac_id}/track/0/mp3", verify=TLS).headers["content-type"] == "audio/mpeg"


def test_query_result_takes_an_array_or_a_string_in_json_or_a_form_and_an_unknown_id_fails_with_why(site, finished):
    task_id = finished[0]
    for kwargs in (
        {"json": {"task_id_list": [task_id, "nope"]}},
        {"json": {"task_id_list": json.dumps([task_id, "nope"])}},
        {"data": {"task_id_list": json.dumps([task_id, "nope"])}},
    ):
        data = httpx.post(site.ace + "/query_result", **kwargs, verify=TLS).json()["data"]
        assert [d["task_id"] for d in data] == [task_id, "nope"]
        assert [d["status"] for d in data] == [1, 2]
        assert data[1]["result"] == "[]"
        assert "not known" in data[1]["error"]
    assert httpx.post(site.ace + "/query_result", verify=TLS).json()["data"] == []
    bad = httpx.post(site.ace + "/query_result", json={"task_id_list": "not a list"}, verify=TLS)
    assert bad.status_code == 400
    assert "task_id_list" in bad.json()["detail"]


def test_audio_is_only_this_servers_results(site):
    for path in ("/etc/passwd", "../../jobs.sqlite3", "%2Fetc%2Fpasswd", "track_0.wav"):
        r = httpx.get(site.ace + "/v1/audio", params={"path": path}, verify=TLS)
        assert r.status_code == 403
        assert r.json()["code"] == 403
    r = httpx.get(site.ace + "/v1/audio", params={"path": "0123456789abcdef-0.mp3"}, verify=TLS)
    assert (r.status_code, r.json()["detail"]) == (404, "Audio file not found")
    r = httpx.get(site.ace + "/v1/audio", verify=TLS)
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["query", "path"]


def _queued_and_total(site) -> tuple[int, int]:
    stats = httpx.get(site.ace + "/v1/stats", verify=TLS).json()["data"]
    return httpx.get(site.url + "/status", verify=TLS).json()["queued_tracks"], stats["jobs"]["total"]


def test_what_cannot_be_served_is_a_400_naming_the_key_and_queues_nothing(site, finished):
    ours = finished[1][0]["file"]
    before = _queued_and_total(site)
    cases = [
        ({"task_type": "cover", "src_audio_path": ours}, "task_type"),
        ({"taskType": "lego"}, "taskType"),
        ({"task_type": "extract"}, "task_type"),
        ({"task_type": "complete"}, "task_type"),
        (
            {"task_type": "repaint", "src_audio_path": ours, "repainting_start": 2, "repainting_end": 1.5},
            "repainting_end",
        ),
        (
            {"task_type": "repaint", "src_audio_path": ours, "repainting_start": -1, "repainting_end": 2},
            "repainting_end",
        ),
        ({"task_type": "repaint", "src_audio_path": ours, "repainting_start": 0}, "repainting_start"),
        ({"reference_audio_path": "/tmp/ref.wav"}, "reference_audio_path"),
        ({"src_audio_path": "/etc/passwd"}, "src_audio_path"),
        ({"ctxAudioPath": "0123456789abcdef-0.mp3"}, "ctxAudioPath"),  # our form, but no such take
        ({"task_type": "repaint", "src_audio_path": ours, "repainting_start": 99}, "repainting_start"),
        ({"batch_size": "two"}, "batch_size"),
    ]
    for body, key in cases:
        r = httpx.post(site.ace + "/release_task", json=body, verify=TLS)
        answer = r.json()
        assert r.status_code == 400, (body, answer)
        assert set(answer) == ERROR_KEYS
        assert answer["code"] == 400
        assert answer["detail"] == answer["error"]
        assert answer["error"].startswith(f"Field '{key}': "), answer["error"]
    upload = {"ref_audio": ("ref.wav", b"RIFF", "audio/wav")}
    r = httpx.post(site.ace + "/release_task", data={"prompt": "x"}, files=upload, verify=TLS)
    assert (r.status_code, r.json()["error"]) == (400, "Field 'ref_audio': this model takes no reference audio.")
    upload = {"src_audio": ("take.mp3", b"\xff\xfb", "audio/mpeg")}
    r = httpx.post(
        site.ace + "/release_task", data={"task_type": "repaint", "repainting_start": "1"}, files=upload, verify=TLS
    )
    assert r.status_code == 400
    assert r.json()["error"].startswith("Field 'src_audio': the file is not audio that can be read")
    assert _queued_and_total(site) == before
    assert not (site.tmp / "state" / "results" / "uploads").is_dir() or not any(
        (site.tmp / "state" / "results" / "uploads").iterdir()
    )  # nothing of the refused file is stored


@pytest.mark.parametrize(
    ("headers", "raw", "status", "says"),
    [
        ({"Content-Type": "application/json"}, b"{nope", 400, "Invalid JSON body"),
        ({"Content-Type": "application/json"}, b"[1, 2]", 400, "JSON payload must be an object"),
        ({"Content-Type": "text/plain"}, b"hello", 415, "Unsupported Content-Type: text/plain"),
        ({"Content-Type": "application/json"}, b" " * 1_000_001, 413, "larger than 1000000 bytes"),
    ],
)
def test_unreadable_bodies_carry_detail_and_the_wrappers_code_and_error(site, headers, raw, status, says):
    r = httpx.post(site.ace + "/release_task", content=raw, headers=headers, verify=TLS)
    answer = r.json()
    assert (r.status_code, answer["code"], answer["data"]) == (status, status, None)
    assert says in answer["detail"]
    assert answer["error"] == answer["detail"]


def test_the_other_routes_answer_in_the_wrapper(site, finished):
    health = httpx.get(site.ace + "/health", verify=TLS).json()
    assert (health["code"], health["data"]["status"]) == (200, "ok")
    models = httpx.get(site.ace + "/v1/models", verify=TLS).json()["data"]
    assert models == {"models": [{"name": "default_backbone", "is_default": True}], "default_model": "default_backbone"}
    stats = httpx.get(site.ace + "/v1/stats", verify=TLS).json()["data"]
    assert set(stats) == {"jobs", "queue_size", "queue_maxsize", "avg_job_seconds"}
    assert set(stats["jobs"]) == {"total", "queued", "running", "succeeded", "failed"}
    assert stats["jobs"]["succeeded"] >= 1
    assert stats["avg_job_seconds"] > 0
    assert stats["queue_maxsize"] == 200
    sample = httpx.post(site.ace + "/create_random_sample", json={"sample_type": "custom_mode"}, verify=TLS).json()[
        "data"
    ]
    assert {"caption", "lyrics", "duration"} <= set(sample)
    simple = httpx.post(site.ace + "/create_random_sample", verify=TLS).json()["data"]
    assert set(simple) == {"description", "instrumental", "vocal_language"}
    formatted = httpx.post(
        site.ace + "/format_input", data={"prompt": "pop, piano", "lyrics": "你好。"}, verify=TLS
    ).json()
    assert (formatted["data"]["caption"], formatted["data"]["lyrics"]) == ("Pop, Piano", "你好.")


def test_the_studio_may_call_it_from_a_local_origin_and_another_origin_may_not(site):
    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    local = httpx.options(site.ace + "/release_task", headers={"Origin": "http://127.0.0.1:5500", **ask}, verify=TLS)
    assert local.status_code == 200
    assert local.headers["access-control-allow-origin"] == "http://127.0.0.1:5500"
    assert "POST" in local.headers["access-control-allow-methods"]
    other = httpx.options(site.ace + "/query_result", headers={"Origin": "https://example.com", **ask}, verify=TLS)
    assert "access-control-allow-origin" not in other.headers


def test_the_dispatcher_listens_on_its_two_ports_and_without_the_setting_on_one(site, tmp_path):
    assert listening_ports(site.api) == {site.api.port, int(site.ace.rsplit(":", 1)[1])}
    port = free_port()
    args = ["backend_api.py", "--port", str(port), "--state-dir", str(tmp_path / "state"), "--num-workers", "0"]
    bare = ServerProcess(args, port, tmp_path / "bare.log")
    try:
        bare.wait_healthy(want=("ok",))
        assert listening_ports(bare) == {port}
    finally:
        bare.stop()


def test_a_port_in_use_refuses_start_up_naming_the_setting(site, tmp_path):
    taken = site.ace.rsplit(":", 1)[1]
    args = ["backend_api.py", "--port", str(free_port()), "--acestep-port", taken, "--num-workers", "0"]
    proc = ServerProcess([*args, "--state-dir", str(tmp_path / "state")], 0, tmp_path / "refused.log")
    assert proc.proc.wait(60) == 2
    assert f"Setting ACESTEP_PORT: cannot listen on 127.0.0.1:{taken}" in proc.log_tail()
    proc.stop()


# ---- a key, a full queue ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """A dispatcher with an API key, no workers and room for two queued takes."""
    tmp = tmp_path_factory.mktemp("keyed")
    port, ace = free_port(), free_port()
    args = ["backend_api.py", "--port", str(port), "--acestep-port", str(ace), "--state-dir", str(tmp / "state")]
    proc = ServerProcess(
        [*args, "--num-workers", "0", "--max-queue", "2", "--api-key", "s3cret"], port, tmp / "api.log"
    )
    proc.wait_healthy(want=("ok",))
    proc.ace = f"http://127.0.0.1:{ace}"  # type: ignore[attr-defined]
    yield proc
    proc.stop()


def test_the_key_is_taken_as_ai_token_or_as_the_authorization_header(keyed):
    release = keyed.ace + "/release_task"
    for kwargs, says in [
        ({"json": {"prompt": "x"}}, "Missing ai_token or Authorization header"),
        ({"json": {"ai_token": "wrong"}, "headers": {"Authorization": "Bearer s3cret"}}, "Invalid ai_token"),
        ({"json": {}, "headers": {"Authorization": "Bearer wrong"}}, "Invalid API key"),
    ]:
        r = httpx.post(release, **kwargs, verify=TLS)
        assert (r.status_code, r.json()["detail"], r.json()["code"]) == (401, says, 401)
    assert httpx.get(keyed.ace + "/v1/stats", verify=TLS).json()["detail"] == "Missing Authorization header"
    for route in ("/v1/lora/status", "/v1/lora/list"):  # an adapter session is the key's: none without one
        assert httpx.get(keyed.ace + route, verify=TLS).json()["detail"] == "Missing Authorization header"
    r = httpx.post(keyed.ace + "/v1/lora/load", json={"lora_path": "x"}, verify=TLS)
    assert (r.status_code, r.json()["detail"]) == (401, "Missing ai_token or Authorization header")
    assert httpx.get(keyed.url + "/adapters", verify=TLS).status_code == 401  # our port's list too
    assert httpx.get(keyed.ace + "/health", verify=TLS).status_code == 200
    by_token = httpx.post(release, json={"ai_token": "s3cret", "batch_size": 1}, verify=TLS).json()
    by_header = httpx.post(
        release, data={"batch_size": "1"}, headers={"Authorization": "Bearer s3cret"}, verify=TLS
    ).json()
    ids = [by_token["data"]["task_id"], by_header["data"]["task_id"]]
    form = {"task_id_list": json.dumps(ids), "ai_token": "s3cret"}
    assert [d["status"] for d in httpx.post(keyed.ace + "/query_result", data=form, verify=TLS).json()["data"]] == [
        0,
        0,
    ]
    stats = httpx.get(keyed.ace + "/v1/stats", headers={"Authorization": "s3cret"}, verify=TLS).json()[
        "data"
    ]  # the bare key
    assert stats["jobs"]["queued"] == 2
    # Our port still wants its Bearer header, and shows the tasks as jobs.
    assert httpx.get(f"{keyed.url}/job/{ids[0]}", verify=TLS).status_code == 401
    job = httpx.get(f"{keyed.url}/job/{ids[0]}", headers={"Authorization": "Bearer s3cret"}, verify=TLS).json()
    assert job["status"] == "queued"

    # The queue holds two takes: a third is 429 with Retry-After, and nothing more is queued.
    full = httpx.post(release, json={"ai_token": "s3cret", "batch_size": 1}, verify=TLS)
    assert full.status_code == 429
    assert full.json()["code"] == 429
    assert "queue is full" in full.json()["detail"]
    assert int(full.headers["retry-after"]) >= 1
    assert (
        httpx.get(keyed.ace + "/v1/stats", headers={"Authorization": "Bearer s3cret"}, verify=TLS).json()["data"][
            "jobs"
        ]["total"]
        == 2
    )
    for task_id in ids:  # every accepted job ends: cancelled here, there is no worker
        httpx.delete(f"{keyed.url}/job/{task_id}", headers={"Authorization": "Bearer s3cret"}, verify=TLS)
    done = httpx.post(keyed.ace + "/query_result", json={"task_id_list": ids, "ai_token": "s3cret"}, verify=TLS).json()
    assert [d["status"] for d in done["data"]] == [2, 2]
    assert done["data"][0]["error"] == "The task was cancelled."


# ---- what reaches a worker --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("acestep_ref")
    ace = free_port()
    c = cluster_of(tmp, [start_reference_worker(tmp, delay=0.1)], "--acestep-port", str(ace))
    c.ace = f"http://127.0.0.1:{ace}"  # type: ignore[attr-defined]
    c.requests = tmp / "reference_requests.jsonl"  # type: ignore[attr-defined]
    yield c
    c.stop()


@pytest.mark.parametrize(
    ("body", "received"),
    [
        ({"caption": "pop, PIANO"}, {"tags": "Pop, Piano", "description": "", "raw_prompt_mode": "tags"}),
        ({"prompt": "a slow song about rain"}, {"description": "a slow song about rain", "raw_prompt_mode": "natural"}),
        ({"lyrics": "[Instrumental]"}, {"language": "Instrumental", "lyrics": ""}),
        ({"lyrics": "[verse]\n你好。世界"}, {"lyrics": "[verse]\n你好.世界", "language": ""}),
        ({"model": "acestep/default_backbone"}, {"backbone_name": "default_backbone"}),
        ({"model": "acestep-v15-turbo"}, {"backbone_name": ""}),  # ACE-Step's primary model: our default
        ({"audio_duration": 90}, {"duration": 2}),  # 1.5 min, in the whole minutes this worker takes
    ],
)
def test_each_mapping_reaches_the_worker(reference, body, received):
    client = AceStepClient(reference.ace)
    task_id = client.release(**{"batch_size": 1, "lyrics": "[verse]\nla la", **body})
    reference.wait_job(task_id)
    sent = json.loads(reference.requests.read_text().splitlines()[-1])
    assert {k: sent[k] for k in received} == received


def test_a_repaint_to_the_end_of_our_take_is_a_retake_that_keeps_its_start(site, client, finished):
    """``task_type: repaint`` of a file this server returned, from 1 s on: our ``continue_from``."""
    source_id, takes = finished
    task_id = client.release(task_type="repaint", src_audio_path=takes[0]["file"], repainting_start=1, seed=5)
    repainted = client.wait(task_id)
    assert len(repainted) == 2  # ACE-Step's default batch_size
    for i, take in enumerate(site.job(task_id)["tracks"]):
        kept = take["metadata"]["continued"]
        assert kept["origin"] == f"{source_id}/0"
        assert kept["frames"] == int(1.0 * 44_100 / 2_048)
        audio, rate = sf.read(io.BytesIO(client.download(repainted[i]).content), always_2d=True)
        assert abs(len(audio) / rate - 3.0) < 0.1  # the source's length, inherited


def test_a_bounded_repaint_of_our_take_keeps_its_start_and_its_end(site, client, finished):
    """``repainting_start`` 1 s to ``repainting_end`` 2 s of a 3 s take: our ``continue_from.end_sec``;
    an end past the source is a retake that runs on to it (an extension at the end)."""
    source_id, takes = finished
    task_id = client.release(
        task_type="repaint", src_audio_path=takes[0]["file"], repainting_start=1, repainting_end=2, audio_duration=30
    )
    repainted = client.wait(task_id)
    fps = 44_100 / 2_048
    for i, take in enumerate(site.job(task_id)["tracks"]):
        span = take["metadata"]["repainted"]
        assert (span["start_frame"], span["end_frame"], span["origin"]) == (int(fps), round(2 * fps), f"{source_id}/0")
        audio, rate = sf.read(io.BytesIO(client.download(repainted[i]).content), always_2d=True)
        assert abs(len(audio) / rate - 3.0) < 0.1  # as long as the source, whatever audio_duration says
    task_id = client.release(task_type="repaint", src_audio_path=takes[0]["file"], repainting_start=1, repainting_end=6)
    (longer, _) = client.wait(task_id)
    audio, rate = sf.read(io.BytesIO(client.download(longer).content), always_2d=True)
    assert abs(len(audio) / rate - 6.0) < 0.1
    assert "repainted" not in site.job(task_id)["tracks"][0]["metadata"]
    task_id = client.release(task_type="repaint", src_audio_path=takes[0]["file"], repainting_start=-2, batch_size=1)
    (opened,) = client.wait(task_id)
    audio, rate = sf.read(io.BytesIO(client.download(opened).content), always_2d=True)
    assert abs(len(audio) / rate - 5.0) < 0.1  # a 2 s opening before the 3 s source
    span = site.job(task_id)["tracks"][0]["metadata"]["repainted"]
    assert (span["start_frame"], span["opening"]) == (0, round(2 * fps))


def test_a_repaint_of_an_uploaded_file_continues_our_upload_of_it(site, client):
    """``task_type: repaint`` with a multipart ``src_audio``: stored and encoded as our upload, then continued."""
    t = np.arange(2 * 44_100) / 44_100
    wav = io.BytesIO()
    sf.write(wav, np.stack([0.3 * np.sin(2 * np.pi * 330 * t)] * 2, 1), 44_100, format="WAV", subtype="PCM_16")
    fields = {
        "task_type": "repaint",
        "repainting_start": "1.5",
        "audio_duration": "4",
        "batch_size": "1",
        "caption": "pop",
        "lyrics": "[verse]\non and on",
    }
    r = httpx.post(
        site.ace + "/release_task",
        data=fields,
        files={"src_audio": ("mine.wav", wav.getvalue(), "audio/wav")},
        verify=TLS,
    )
    assert r.status_code == 200, r.text
    task_id = r.json()["data"]["task_id"]
    (take,) = client.wait(task_id)
    kept = site.job(task_id)["tracks"][0]["metadata"]["continued"]
    assert kept["origin"].startswith("upload/")
    assert kept["frames"] == int(1.5 * 44_100 / 2_048)
    upload = httpx.get(f"{site.url}/uploads/{kept['origin'].removeprefix('upload/')}", timeout=10, verify=TLS).json()
    assert (upload["status"], upload["filename"], upload["frames"]) == ("ready", "mine.wav", 2 * 44_100 // 2_048)
    audio, rate = sf.read(io.BytesIO(client.download(take).content), always_2d=True)
    assert abs(len(audio) / rate - 4.0) < 0.1
    r = httpx.post(
        site.ace + "/release_task",
        data={**fields, "repainting_start": "9"},
        files={"src_audio": ("mine.wav", wav.getvalue(), "audio/wav")},
        verify=TLS,
    )
    assert (r.status_code, r.json()["error"]) == (
        400,
        "Field 'repainting_start': is past the end of the source (2.00 s).",
    )


def test_the_lora_calls_keep_a_session_of_the_key_and_refuse_what_the_fleet_cannot_load(site):
    """Tone workers offer no adapter: a load names lora_path; status, toggle and scale answer in ACE-Step's form."""
    status = httpx.get(site.ace + "/v1/lora/status", verify=TLS).json()
    assert status["code"] == 200
    assert (status["data"]["lora_loaded"], status["data"]["use_lora"], status["data"]["lora_scale"]) == (
        False,
        False,
        1.0,
    )
    r = httpx.post(site.ace + "/v1/lora/load", json={"lora_path": "/models/loras/studio-a"}, verify=TLS)
    assert r.status_code == 400
    assert r.json()["error"].startswith("Field 'lora_path': no worker here can load adapter 'studio-a'")
    r = httpx.post(site.ace + "/v1/lora/load", json={"lora_path": "../../etc/passwd x"}, verify=TLS)
    assert r.status_code == 400
    assert "is not an adapter name" in r.json()["error"]
    r = httpx.post(site.ace + "/v1/lora/toggle", json={"use_lora": True}, verify=TLS)
    assert (r.status_code, r.json()["error"]) == (400, "No LoRA adapter loaded: call /v1/lora/load first")
    r = httpx.post(site.ace + "/v1/lora/scale", json={"scale": 2}, verify=TLS)
    assert r.status_code == 400
    assert r.json()["error"].startswith("Field 'scale': must be a number from 0 to 1")
    r = httpx.post(site.ace + "/v1/lora/scale", json={"scale": 0.5}, verify=TLS)
    assert r.json()["data"]["scale"] == 0.5
    assert httpx.get(site.ace + "/v1/lora/status", verify=TLS).json()["data"]["lora_scale"] == 0.5
    assert httpx.post(site.ace + "/v1/lora/unload", verify=TLS).json()["data"]["message"] == "No LoRA was loaded"
    assert httpx.get(site.ace + "/v1/lora/list", verify=TLS).json()["data"] == []
