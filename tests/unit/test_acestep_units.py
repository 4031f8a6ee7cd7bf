"""ACE-Step's dialect, one piece at a time: parameters, bodies, the translation, answers, auth, samples.

In-process and pure: the same pieces run through a real dispatcher in tests/process/test_acestep_http.py.
"""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest

from songserve.api.acestep import auth, bodies, samples
from songserve.api.acestep.answers import query_item, unknown_item
from songserve.api.acestep.app import listen
from songserve.api.acestep.failures import AceError
from songserve.api.acestep.files import AudioRef, parse_id, parse_source
from songserve.api.acestep.params import Params
from songserve.api.acestep.translate import Context, Repaint, Task, read_task, tag_prompt
from songserve.api.http.tags import TAGS
from songserve.api.jobs.records import Job, Track
from songserve.api.jobs.states import TrackStatus
from songserve.api.jobs.views import job_view
from songserve.api.service.keys import ApiKeys
from songserve.http.forms import FormLimits
from songserve.schemas import GenerateRequest

CTX = Context(TAGS, max_tracks=4, backbones=("default_backbone", "large"), strict=False)
STRICT = Context(TAGS, max_tracks=4, backbones=("default_backbone", "large"), strict=True)
OURS = "0123456789abcdef-0.mp3"


def task(body: dict, ctx: Context = CTX, uploads: dict | None = None) -> Task:
    out = read_task(Params(body), uploads or {}, ctx)
    assert isinstance(out, Task)
    return out


def refused(body: dict, ctx: Context = CTX, uploads: dict | None = None) -> str:
    with pytest.raises(AceError) as err:
        read_task(Params(body), uploads or {}, ctx)
    assert err.value.http_status == 400
    return str(err.value)


# ---- parameters -----------------------------------------------------------------------------------
def test_aliases_are_tried_in_acesteps_order_and_the_body_comes_before_nested_sources():
    p = Params({"caption": "b", "prompt": "a", "param_obj": {"duration": 30}, "metas": {"duration": 40}})
    assert p.text("prompt") == "a"
    assert p.number("audio_duration") == ("param_obj.duration", 30.0)
    assert Params({"caption": "b"}).text("prompt") == "b"
    assert Params({"metas": {"bpm": 90}, "param_obj": {"bpm": 80}}).find("bpm") == ("param_obj.bpm", 80)


def test_an_empty_value_counts_as_sent_and_hides_a_nested_one():
    assert Params({"prompt": "", "metas": {"prompt": "hidden"}}).text("prompt") == ""


def test_nested_sources_may_be_json_strings_and_the_first_truthy_metas_key_wins():
    p = Params({"metas": {}, "metadata": json.dumps({"keyScale": "C major"}), "user_metadata": {"key": "D"}})
    assert p.find("key_scale") == ("metadata.keyScale", "C major")
    assert Params({"param_obj": "not json"}).find("bpm") is None  # unreadable text is {}
    with pytest.raises(AceError, match="param_obj"):
        Params({"param_obj": "[1, 2]"})


@pytest.mark.parametrize(
    ("value", "read"),
    [(True, True), ("true", True), ("1", True), (" Yes ", True), ("on", True), ("y", True), (1, True)]
    + [(False, False), ("false", False), ("0", False), ("no", False), ("abc", False), (0, False), ("", None)],
)
def test_booleans_are_read_as_acestep_reads_them(value, read):
    assert Params({"use_random_seed": value}).flag("use_random_seed", None) is read  # type: ignore[arg-type]


def test_numbers_from_strings_and_whole_floats_and_a_bad_number_names_its_key():
    assert Params({"batch_size": "3"}).whole("batch_size") == ("batch_size", 3)
    assert Params({"batch_size": 1.0}).whole("batch_size") == ("batch_size", 1)  # ACE-Step drops it for 2
    assert Params({"batch_size": ""}).whole("batch_size") is None
    with pytest.raises(AceError, match="'batch_size': must be a whole number"):
        Params({"batch_size": 1.5}).whole("batch_size")
    with pytest.raises(AceError, match="'targetDuration': must be a number"):
        Params({"targetDuration": "long"}).number("audio_duration")


def test_every_key_not_used_is_listed_as_sent():
    p = Params({"prompt": "x", "thinking": True, "ai_token": "k", "metas": {"bpm": 90}, "foo": None})
    p.text("prompt")
    assert p.unread() == ["thinking", "metas.bpm"]


# ---- bodies -----------------------------------------------------------------------------------------
FORM = FormLimits(body_bytes=2**20, field_bytes=2**16, file_bytes=2**20)


def _release(ct: str | None, raw: bytes) -> bodies.Body:
    """What ``/release_task`` reads: multipart through the streaming reader, any other body as a whole."""
    return bodies.read_multipart(ct or "", raw, FORM) if bodies.is_multipart(ct) else bodies.release_body(ct, raw)


def _multipart(data: dict, files: dict) -> tuple[str, bytes]:
    req = httpx.Request("POST", "http://x/", data=data, files=files)
    return req.headers["content-type"], req.read()


def test_json_and_plus_json_and_untyped_json_bodies():
    for ct in ("application/json", "application/json; charset=utf-8", "application/vnd.api+json", None, "text/plain"):
        assert bodies.release_body(ct, b' {"prompt": "x"}').fields == {"prompt": "x"}


def test_form_bodies_work_with_their_uploads():
    assert bodies.release_body("application/x-www-form-urlencoded", b"prompt=a+b&batch_size=2").fields == {
        "prompt": "a b",
        "batch_size": "2",
    }
    ct, raw = _multipart(
        {"prompt": "流行, piano", "empty": ""}, {"src_audio": ("x.mp3", b"\x00\r\n--\xff", "audio/mpeg")}
    )
    body = _release(ct, raw)
    assert body.fields == {"prompt": "流行, piano", "empty": ""}
    up = body.uploads["src_audio"]
    assert (up.filename, up.content_type, up.file.read()) == ("x.mp3", "audio/mpeg", b"\x00\r\n--\xff")
    body.close()
    assert bodies.release_body(None, b"prompt=a&prompt=b").fields == {"prompt": "a"}  # parse_qs: the first


@pytest.mark.parametrize(
    ("ct", "raw", "status", "says"),
    [
        ("application/json", b"[1]", 400, "JSON payload must be an object"),
        ("application/json", b"{nope", 400, "Invalid JSON body"),
        (None, b"{nope", 400, "hint: set 'Content-Type: application/json'"),
        ("text/plain", b"hello", 415, "Unsupported Content-Type: text/plain"),
        (None, b"", 415, "Unsupported Content-Type: (missing)"),
        ("multipart/form-data; boundary=zz", b"no parts here", 400, "multipart/form-data body cannot be read"),
    ],
)
def test_bodies_that_cannot_be_read_say_why(ct, raw, status, says):
    with pytest.raises(AceError) as err:
        _release(ct, raw)
    assert err.value.http_status == status
    assert says in str(err.value)


def test_the_other_routes_read_json_when_the_type_says_so_else_a_form():
    assert bodies.small_body(None, b"").fields == {}
    assert bodies.small_body("application/x-www-form-urlencoded", b'task_id_list=["a"]').fields == {
        "task_id_list": '["a"]'
    }
    assert bodies.small_body("application/json", b'{"task_id_list": ["a"]}').fields == {"task_id_list": ["a"]}


# ---- the translation --------------------------------------------------------------------------------
def test_a_caption_of_known_tags_is_a_tags_prompt_in_the_catalogues_spelling():
    assert tag_prompt("pop,  PIANO ,", TAGS) == ("tags", "Pop, Piano")
    assert tag_prompt("pop, a piano at night", TAGS) == ("natural", "pop, a piano at night")
    assert tag_prompt("", TAGS) == ("natural", "")
    t = task({"caption": "Pop, Female Vocals"})
    assert (t.request.prompt_mode, t.request.tags, t.request.prompt, t.prompt_mode) == (
        "tags",
        "Pop, Female Vocals",
        "",
        "tags",
    )
    t = task({"prompt": "a slow song about the sea"})
    assert (t.request.prompt_mode, t.request.prompt, t.request.tags) == ("natural", "a slow song about the sea", "")


@pytest.mark.parametrize("lyrics", ["", "  ", "[inst]", "[Instrumental]", " [INST] "])
def test_acesteps_instrumental_lyrics_make_an_instrumental_song(lyrics):
    assert task({"lyrics": lyrics}).request.mode == "instrumental"


def test_lyrics_are_passed_for_our_cleaning_and_make_a_vocal_song():
    r = task({"lyrics": "[verse]\n你好。"}).request
    assert (r.mode, r.lyrics) == ("vocal", "[verse]\n你好。")


def test_seconds_become_minutes_and_no_length_is_our_default():
    assert task({"audio_duration": 90}).request.duration == 1.5
    assert task({"targetDuration": "30"}).request.duration == 0.5
    assert task({}).request.duration == GenerateRequest().duration
    t = task({"duration": -1})
    assert t.request.duration == GenerateRequest().duration
    assert t.adjusted == {"duration": {"from": -1.0, "to": GenerateRequest().duration * 60}}


def test_batch_size_defaults_to_two_and_is_clamped_into_our_limit_saying_so():
    assert task({}).request.num_tracks == 2
    t = task({"batch_size": 8})
    assert (t.request.num_tracks, t.adjusted) == (4, {"batch_size": {"from": 8, "to": 4}})
    assert "'batch_size': must be between 1 and 4" in refused({"batch_size": 8}, STRICT)


def test_seeds_follow_use_random_seed():
    t = task({"seed": 42})  # use_random_seed defaults to true: the seed is ignored, as ACE-Step ignores it
    assert (t.request.seed, "seed" in t.ignored) == (None, True)
    assert task({"use_random_seed": False, "seed": 42}).request.seed == 42
    assert task({"useRandomSeed": "false", "seed": "7, 8"}).request.seed == 7
    assert task({"use_random_seed": "0", "seed": [7, 8, 99]}, CTX).request.seed == 7  # beyond batch_size 2
    assert task({"use_random_seed": False, "seed": -1}).request.seed is None
    assert "takes use seed, seed+1" in refused({"use_random_seed": False, "seed": "7,9"})
    assert "'seed'" in refused({"use_random_seed": False, "seed": 2**32})
    for bad in ("abc", "inf", True):
        assert "'seed': must be a whole number" in refused({"use_random_seed": False, "seed": bad})


def test_model_names_a_backbone_and_another_name_falls_back_saying_so():
    assert task({"model": "large"}).request.backbone == "large"
    assert task({"dit_model": "acestep/large"}).request.backbone == "large"
    t = task({"modelName": "acestep-v15-turbo"})
    assert t.request.backbone is None
    assert t.adjusted == {"modelName": {"from": "acestep-v15-turbo", "to": "default_backbone"}}
    assert "'model': must be one of default_backbone, large" in refused({"model": "x"}, STRICT)


def test_audio_format_picks_the_file_and_an_unknown_one_is_flac_as_acestep_saves_it():
    assert task({}).audio_format == "mp3"
    assert task({"audio_format": "WAV"}).audio_format == "wav"
    t = task({"audio_format": "ogg"})
    assert (t.audio_format, t.adjusted) == ("flac", {"audio_format": {"from": "ogg", "to": "flac"}})
    assert t.request.acestep is not None
    assert t.request.acestep.model_dump() == {"audio_format": "flac", "caption": ""}
    assert "format" in task({"format": "wav"}).ignored  # an alias of use_format, not of audio_format


def test_what_means_nothing_here_is_listed_as_ignored():
    t = task({"prompt": "x", "thinking": True, "inference_steps": 8, "lm_temperature": 0.8, "metas": {"bpm": 120}})
    assert t.ignored == ["thinking", "inference_steps", "lm_temperature", "metas.bpm"]
    t = task({"srcAudioPath": OURS, "repainting_start": 3})  # text2music: a source is checked, then unused
    assert (t.source, t.ignored) == (AudioRef("0123456789abcdef", 0, "mp3"), ["repainting_start", "srcAudioPath"])
    assert t.extra() == {"ignored": t.ignored, "adjusted": {}, "prompt_mode": "natural"}


@pytest.mark.parametrize("kind", ["cover", "lego", "extract", "complete", "music_continuation"])
def test_other_task_types_are_refused_naming_the_key(kind):
    assert refused({"taskType": kind}).startswith(f"Field 'taskType': '{kind}' is not served here")


def test_reference_audio_and_foreign_sources_are_refused():
    assert "'ref_audio_path': this model takes no reference audio" in refused({"ref_audio_path": "/tmp/a.wav"})
    upload = bodies.Upload("reference_audio", "a.wav", "audio/wav", b"x")
    assert "'reference_audio'" in refused({}, uploads={"reference_audio": upload})
    for foreign in ("/etc/passwd", "/v1/audio?path=%2Ftmp%2Fx.mp3", "0123456789abcdef-0.ogg"):
        assert "'src_audio_path': is not an audio file this server returned" in refused({"src_audio_path": foreign})


def test_a_repaint_from_our_file_is_read_to_the_end_or_to_a_finite_end_after_its_start():
    for end in (None, -1, 0, "-1", ""):
        body = {"task_type": "repaint", "src_audio_path": f"/v1/audio?path={OURS}", "repainting_start": "12.5"}
        out = read_task(Params({**body, "repainting_end": end}), {}, CTX)
        assert isinstance(out, Repaint)
        assert (out.start, out.end, out.source) == (12.5, None, AudioRef("0123456789abcdef", 0, "mp3"))
    bounded = {"task_type": "repaint", "src_audio_path": OURS, "repainting_start": 10, "repainting_end": "30"}
    out = read_task(Params(bounded), {}, CTX)
    assert isinstance(out, Repaint)
    assert (out.start, out.end) == (10, 30)
    assert out.task.keys["end_sec"] == "repainting_end"
    assert "'repainting_end': must come after repainting_start (10 s)" in refused({**bounded, "repainting_end": 10})
    assert "'repainting_end': must come after repainting_start (10 s)" in refused({**bounded, "repainting_end": 4})
    assert "repaint needs a source" in refused({"task_type": "repaint"})
    opening = read_task(Params({"task_type": "repaint", "src_audio_path": OURS, "repainting_start": -2}), {}, CTX)
    assert isinstance(opening, Repaint)
    assert (opening.start, opening.end) == (-2, None)  # an extension at the start: a 2 s opening
    assert "'repainting_end': must be -1 with a negative repainting_start" in refused(
        {"task_type": "repaint", "src_audio_path": OURS, "repainting_start": -2, "repainting_end": 3}
    )
    upload = bodies.Upload("src_audio", "a.mp3", "audio/mpeg", b"x")
    out = read_task(Params({"task_type": "repaint"}), {"src_audio": upload}, CTX)
    assert isinstance(out, Repaint)
    assert out.source is upload


# ---- files ------------------------------------------------------------------------------------------
def test_audio_ids_are_opaque_and_sources_are_read_back_in_every_form_a_client_has_them():
    ref = AudioRef("0123456789abcdef", 1, "flac")
    assert (ref.id, ref.url) == ("0123456789abcdef-1.flac", "/v1/audio?path=0123456789abcdef-1.flac")
    for given in (ref.id, ref.url, "http://host:8011" + ref.url, "/v1/audio?path=0123456789abcdef-1%2Eflac"):
        assert parse_source(given) == ref
    for bad in (
        "/tmp/x.flac",
        "../0123456789abcdef-1.flac",
        "/v1/audio?path=0123456789abcdef-1.flac%0A",
        "/other?path=" + ref.id,
    ):
        assert parse_source(bad) is None
    assert parse_id("0123456789ABCDEF-1.mp3") is None


# ---- answers ----------------------------------------------------------------------------------------
def _job(statuses: list[TrackStatus], fmt: str = "wav") -> Job:
    req = GenerateRequest.model_validate(
        {"prompt_mode": "tags", "tags": "Pop", "lyrics": "hi。", "acestep": {"audio_format": fmt, "caption": "pop"}}
    )
    tracks = [Track("0123456789abcdef", i, 7 + i, status=s, duration_sec=4.0) for i, s in enumerate(statuses)]
    for t in tracks:
        if t.status is TrackStatus.done:
            t.metadata = {"models": {"backbone": "bb", "superres": "sr"}}
        if t.status is TrackStatus.error:
            t.error = "out of memory"
    return Job("0123456789abcdef", 1, 1700000000.5, req, "hi.", tracks)


def _entry(statuses: list[TrackStatus]) -> tuple[dict, list[dict]]:
    job = _job(statuses)
    entry = query_item(job.job_id, job, job_view(job, {}, None))
    assert isinstance(entry["result"], str)  # a JSON string, as ACE-Step's clients parse it
    return entry, json.loads(entry["result"])


def test_a_done_task_has_one_item_per_take_with_its_file_seeds_and_length():
    entry, items = _entry([TrackStatus.done, TrackStatus.done])
    assert (entry["status"], entry["progress_text"]) == (1, "take 1/2: Done; take 2/2: Done")
    assert [i["file"] for i in items] == [
        "/v1/audio?path=0123456789abcdef-0.wav",
        "/v1/audio?path=0123456789abcdef-1.wav",
    ]
    first = items[0]
    assert (first["status"], first["create_time"], first["seed_value"], first["seed"]) == (1, 1700000000, "7,8", 7)
    assert (first["prompt"], first["lyrics"], first["dit_model"], first["lm_model"]) == ("Pop", "hi.", "bb", "sr")
    assert first["metas"] == {
        "duration": 4.0,
        "bpm": None,
        "genres": None,
        "keyscale": None,
        "timesignature": None,
        "prompt": "pop",
        "lyrics": "hi。",
    }


def test_a_partly_failed_task_is_done_with_its_done_takes_and_a_failed_one_says_why():
    entry, items = _entry([TrackStatus.done, TrackStatus.error])
    assert (entry["status"], len(items)) == (1, 1)
    assert "take 2/2: Error (out of memory)" in entry["progress_text"]
    entry, items = _entry([TrackStatus.error])
    assert (entry["status"], entry["error"], items[0]["status"]) == (2, "take 0: out of memory", 2)


def test_a_running_task_is_zero_with_its_progress():
    entry, items = _entry([TrackStatus.queued])
    assert (entry["status"], entry["progress_text"], items[0]["progress"]) == (0, "Queued", 0.0)


def test_an_unknown_task_is_failed_with_a_reason_not_queued_forever():
    item = unknown_item("nope")
    assert (item["status"], item["result"]) == (2, "[]")
    assert "not known" in item["error"]


# ---- auth and samples -------------------------------------------------------------------------------
def test_the_key_comes_from_ai_token_first_then_the_header_bearer_or_bare():
    keys, none = ApiKeys.load("k", None), ApiKeys.load("", None)
    assert auth.check_body_or_header(keys, {"ai_token": "k"}, None).name == "default"
    auth.check_body_or_header(keys, {}, "Bearer k")
    auth.check_body_or_header(keys, {}, "k")
    assert auth.check_body_or_header(none, {}, None) is None
    for fields, header, says in [
        ({"ai_token": "bad"}, "Bearer k", "Invalid ai_token"),
        ({}, "Bearer bad", "Invalid API key"),
        ({"ai_token": ""}, None, "Missing ai_token or Authorization header"),
    ]:
        with pytest.raises(AceError, match=says) as err:
            auth.check_body_or_header(keys, fields, header)
        assert err.value.http_status == 401
    with pytest.raises(AceError, match="Missing Authorization header"):
        auth.check_header(keys, None)


def test_samples_have_acesteps_two_shapes_and_their_tag_captions_read_as_tags():
    assert set(samples.random_sample("")) == {"description", "instrumental", "vocal_language"}
    keys = {"think", "caption", "lyrics", "bpm", "duration", "keyscale", "language", "timesignature"}
    assert set(samples.random_sample("custom_mode")) == keys
    modes = {tag_prompt(e["caption"], TAGS)[0] for e in samples.examples()["text2music"]}
    assert modes == {"tags", "natural"}


def test_format_input_answers_with_our_cleaning_and_our_reading_of_the_prompt():
    out = samples.format_input(
        {"prompt": "pop, piano", "lyrics": "你好。", "param_obj": '{"bpm": 90, "language": "zh"}'}, TAGS, "reference"
    )
    assert (out["caption"], out["lyrics"], out["bpm"], out["vocal_language"]) == ("Pop, Piano", "你好.", 90, "zh")
    assert (out["prompt_mode"], out["instrumental"]) == ("tags", False)
    assert samples.format_input({"lyrics": "[inst]"}, TAGS, "reference")["instrumental"] is True


# ---- the second socket ------------------------------------------------------------------------------
def test_the_second_socket_is_tcp_so_its_answers_are_not_held_for_a_delayed_ack():
    """asyncio sets TCP_NODELAY only on sockets whose proto says TCP (a socket made with proto 0 made
    every answer on our port wait ~40 ms once ACESTEP_PORT was set: bench P1/P2)."""

    async def accepted_nodelay() -> list[int]:
        sock = listen("127.0.0.1", 0, "ACESTEP_PORT")
        seen: list[int] = []

        async def on(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            seen.append(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on, sock=sock)
        reader, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        await reader.read()
        writer.close()
        server.close()
        await server.wait_closed()
        return seen

    assert asyncio.run(accepted_nodelay()) == [1]


def test_the_setting_needs_its_own_port_and_empty_is_unset(monkeypatch):
    from songserve.api.settings import DispatcherSettings
    from songserve.errors import ConfigError
    from songserve.process.settings import load_settings

    with pytest.raises(ConfigError, match="acestep_port: .*must differ from API_PORT"):
        load_settings(DispatcherSettings, ["--port", "9000", "--acestep-port", "9000"])
    assert load_settings(DispatcherSettings, ["--acestep-port", "8011"]).acestep_port == 8011
    monkeypatch.setenv("ACESTEP_PORT", "")
    assert load_settings(DispatcherSettings, []).acestep_port is None
    monkeypatch.setenv("ACESTEP_PORT", "8012")
    assert load_settings(DispatcherSettings, []).acestep_port == 8012
