"""Bodies the reference backend accepts are accepted here, read as it reads them, with the changes reported.

In-process: ``normalize`` over a table of the reference's accepted bodies (lenient and strict), the
extensions' own validation, the tag catalogue loader. Through real processes: a dispatcher with a
test-pipeline worker, ``STRICT_REQUESTS``, ``TAGS_FILE`` at start-up, ``seed_override`` 0 on a worker,
and ``run_backend.sh --workers-only`` with ``WORKER_TOKEN=off``.
"""

from __future__ import annotations

import json
import os
import subprocess

import httpx
import pytest
from pydantic import ValidationError

from songserve.api.http import tags as tag_catalogue
from songserve.api.service.requests import RequestLimits, normalize
from songserve.errors import ConfigError, FieldError
from songserve.schemas import GenerateRequest
from tests.support.http import TLS
from tests.support.servers import ROOT, Cluster, ServerProcess, free_port, wait_for

LIMITS = RequestLimits(min_duration=0.05, max_duration=10.0, max_tracks=4, max_lyrics_chars=100)
KHALA_FRONTEND = {  # what the reference frontend sends
    "mode": "vocal",
    "prompt_mode": "tags",
    "prompt": "",
    "tags": "Mandopop, Female Vocals, Acoustic Guitar, Piano, Atmospheric, Modern Production",
    "lyrics": "[Verse]\nhello",
    "duration": 3,
    "top_k_bb": 40,
    "temperature": 1.0,
}
LONG = "Pop, " * 300  # 1,500 characters

# (body sent, fields of the request used afterwards, adjusted as reported)
ACCEPTED = [
    (KHALA_FRONTEND, {"duration": 3.0, "top_k_bb": 40, "mode": "vocal"}, {}),
    ({"tags": "pop"}, {"mode": "vocal", "lyrics": ""}, {}),  # vocal with empty lyrics generates
    ({"duration": 15}, {"duration": 10.0}, {"duration": {"from": 15, "to": 10.0}}),
    ({"duration": 0}, {"duration": 1.0}, {"duration": {"from": 0, "to": 1.0}}),
    ({"duration": -2}, {"duration": 1.0}, {"duration": {"from": -2, "to": 1.0}}),
    ({"duration": 0.01}, {"duration": 0.05}, {"duration": {"from": 0.01, "to": 0.05}}),
    ({"duration": "3"}, {"duration": 3.0}, {"duration": {"from": "3", "to": 3.0}}),
    ({"duration": 3.0}, {"duration": 3.0}, {}),
    ({"duration": 2.5}, {"duration": 2.5}, {}),  # fractions of a minute: our extension
    ({"top_k_bb": "40"}, {"top_k_bb": 40}, {"top_k_bb": {"from": "40", "to": 40}}),
    ({"top_k_bb": 40.0}, {"top_k_bb": 40}, {}),
    ({"top_k_bb": 250}, {"top_k_bb": 200}, {"top_k_bb": {"from": 250, "to": 200}}),
    ({"top_k_bb": 0}, {"top_k_bb": 1}, {"top_k_bb": {"from": 0, "to": 1}}),
    ({"temperature": 1.5}, {"temperature": 1.4}, {"temperature": {"from": 1.5, "to": 1.4}}),
    ({"temperature": 0.1}, {"temperature": 0.6}, {"temperature": {"from": 0.1, "to": 0.6}}),
    ({"temperature": "0.9"}, {"temperature": 0.9}, {"temperature": {"from": "0.9", "to": 0.9}}),
    ({"temperature": 1}, {"temperature": 1.0}, {}),
    ({"mode": "song"}, {"mode": "vocal"}, {"mode": {"from": "song", "to": "vocal"}}),
    ({"mode": "Instrumental"}, {"mode": "vocal"}, {"mode": {"from": "Instrumental", "to": "vocal"}}),
    ({"prompt_mode": "prompt"}, {"prompt_mode": "natural"}, {"prompt_mode": {"from": "prompt", "to": "natural"}}),
    ({"prompt_mode": "natural", "prompt": LONG}, {"prompt": LONG}, {}),
    ({"tags": LONG}, {"tags": LONG}, {}),
    (
        {"duration": "10", "top_k_bb": "200", "temperature": "1.4"},
        {"duration": 10.0, "top_k_bb": 200, "temperature": 1.4},
        {
            "duration": {"from": "10", "to": 10.0},
            "top_k_bb": {"from": "200", "to": 200},
            "temperature": {"from": "1.4", "to": 1.4},
        },
    ),
    ({"mode": "instrumental", "lyrics": "la la"}, {"mode": "instrumental"}, {}),
    ({"num_tracks": "3"}, {"num_tracks": 3}, {"num_tracks": {"from": "3", "to": 3}}),
]


@pytest.mark.parametrize(("body", "used", "adjusted"), ACCEPTED)
def test_reference_bodies_are_accepted_and_changes_reported(body, used, adjusted):
    n = normalize(GenerateRequest.model_validate(body), LIMITS)
    assert n.adjusted == adjusted
    for name, value in used.items():
        assert getattr(n.request, name) == value, name
    assert type(n.request.top_k_bb) is int
    assert type(n.request.duration) is float
    if n.request.mode == "instrumental":
        assert n.cleaned_lyrics == ""
    json.dumps(n.adjusted)  # goes into the HTTP answer as it is


def test_lyrics_are_cleaned_with_the_configured_mode():
    req = GenerateRequest(lyrics="Привет。\r\n\r\n\r\nhеllo")
    assert normalize(req, LIMITS).cleaned_lyrics == "Пpивeт.\r\n\r\n\r\nhello"
    assert normalize(req, LIMITS, cleaning="preserve-scripts").cleaned_lyrics == "Привет.\r\n\r\n\r\nhello"


# (body, the field a strict dispatcher names)
STRICT_REFUSED = [
    ({"duration": 15, "lyrics": "x"}, "duration"),
    ({"duration": 0, "lyrics": "x"}, "duration"),
    ({"duration": 0.01, "lyrics": "x"}, "duration"),
    ({"top_k_bb": 250, "lyrics": "x"}, "top_k_bb"),
    ({"temperature": 1.5, "lyrics": "x"}, "temperature"),
    ({"mode": "song", "lyrics": "x"}, "mode"),
    ({"prompt_mode": "prompt", "lyrics": "x"}, "prompt_mode"),
    ({"tags": LONG, "lyrics": "x"}, "tags"),
    ({"prompt": LONG, "lyrics": "x"}, "prompt"),
    ({"tags": "pop"}, "lyrics"),
    ({"lyrics": " ★ \u200b "}, "lyrics"),
]


@pytest.mark.parametrize(("body", "field"), STRICT_REFUSED)
def test_strict_mode_refuses_what_the_reference_would_change(body, field):
    req = GenerateRequest.model_validate(body)
    normalize(req, LIMITS)  # accepted when not strict
    with pytest.raises(FieldError) as err:
        normalize(req, LIMITS, strict=True)
    assert err.value.http_status == 422
    assert err.value.detail[0]["loc"] == ["body", field]
    assert f"'{field}'" in str(err.value)


def test_strict_mode_still_coerces_types():
    n = normalize(GenerateRequest.model_validate({"duration": "2", "lyrics": "x"}), LIMITS, strict=True)
    assert n.request.duration == 2.0
    assert n.adjusted == {"duration": {"from": "2", "to": 2.0}}


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize(
    ("body", "limits", "field"),
    [
        ({"num_tracks": 5}, LIMITS, "num_tracks"),
        ({"backbone": "big"}, RequestLimits(backbones=("default_backbone",)), "backbone"),
        ({"superres": "big"}, RequestLimits(superres=("default_superres",)), "superres"),
        ({"lyrics": "x" * 101}, LIMITS, "lyrics"),
    ],
)
def test_extensions_keep_their_own_validation(body, limits, field, strict):
    with pytest.raises(FieldError) as err:
        normalize(GenerateRequest.model_validate({"lyrics": "x", **body}), limits, strict=strict)
    assert err.value.detail[0]["loc"] == ["body", field]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"priority": 10}, "priority"),
        ({"seed": -1}, "seed"),
        ({"top_k_sr": 0}, "top_k_sr"),
        ({"num_tracks": 0}, "num_tracks"),
        ({"duration": "long"}, "duration"),
        ({"top_k_bb": 3.5}, "top_k_bb"),
        ({"temperature": "hot"}, "temperature"),
        ({"mode": 1}, "mode"),
        ({"tags": None}, "tags"),
        ({"duration": float("nan")}, "duration"),
    ],
)
def test_values_that_cannot_be_read_are_refused_naming_the_field(body, field):
    with pytest.raises(ValidationError) as err:
        GenerateRequest.model_validate(body)
    assert err.value.errors()[0]["loc"] == (field,)


# ---- the tag catalogue ------------------------------------------------------------------------------


def test_builtin_catalogue_has_the_reference_groups_and_frontend_defaults():
    cat = tag_catalogue.load_catalogue(tag_catalogue.BUILTIN)
    assert list(cat) == ["genre_style", "vocal_instrument", "emotion_mood", "production_other"]
    assert [c["label"] for c in cat.values()] == [
        "流派/风格 (Genre/Style)",
        "人声/乐器 (Vocals/Instruments)",
        "情感/氛围 (Emotion/Mood)",
        "节奏/制作/其他 (Rhythm/Production/Other)",
    ]
    every = [t for c in cat.values() for t in c["tags"]]
    assert len(every) == len(set(every)) == 197
    assert set(tag_catalogue.REFERENCE_DEFAULTS) <= set(every)
    assert "Mandopop" in cat["genre_style"]["tags"]
    assert "Female Vocals" in cat["vocal_instrument"]["tags"]


def test_a_reference_style_file_maps_onto_our_shape(tmp_path):
    path = tmp_path / "tags.json"
    path.write_text(
        json.dumps(
            {"genre_style": {"tags": ["Mandopop", " Pop "]}, "emotion_mood": ["Atmospheric"], "extra_group": ["X"]}
        )
    )
    assert tag_catalogue.load_catalogue(path) == {
        "genre_style": {"label": "Genre/Style", "tags": ["Mandopop", "Pop"]},
        "emotion_mood": {"label": "Emotion/Mood", "tags": ["Atmospheric"]},
        "extra_group": {"label": "Extra Group", "tags": ["X"]},
    }


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (None, "no such file"),
        ("{not json", "not valid JSON"),
        ("[]", "JSON object of categories"),
        ('{"genre_style": {"tags": []}}', "non-empty 'tags'"),
        ('{"genre_style": {"tags": ["Pop", 3]}}', "not a non-empty string"),
        ('{"genre_style": 7}', "must be an object"),
    ],
)
def test_a_bad_catalogue_file_is_refused_naming_the_path(tmp_path, text, reason):
    path = tmp_path / "tags.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError) as err:
        tag_catalogue.load_catalogue(path)
    message = str(err.value)
    assert str(path) in message
    assert reason in message
    assert "\n" not in message


# ---- through real processes ---------------------------------------------------------------------


def test_reference_bodies_through_a_real_dispatcher(tmp_path):
    with Cluster(tmp_path, workers=1, delay=0.2, api_args=("--max-duration", "0.1")) as c:
        body = {"tags": "Mandopop, Female Vocals", "duration": 15, "top_k_bb": "250", "temperature": 1.5}
        r = httpx.post(c.url + "/generate", json={**body, "mode": "song", "num_tracks": 1}, timeout=10, verify=TLS)
        assert r.status_code == 200, r.text
        a = r.json()
        assert a["adjusted"] == {
            "duration": {"from": 15, "to": 0.1},
            "top_k_bb": {"from": "250", "to": 200},
            "temperature": {"from": 1.5, "to": 1.4},
            "mode": {"from": "song", "to": "vocal"},
        }
        job = c.wait_job(a["job_id"])
        assert job["status"] == "completed"
        assert job["cleaned_lyrics"] == ""
        assert abs(job["tracks"][0]["duration_sec"] - 6.0) < 0.1  # 0.1 minute, the clamped duration
        wait_for(lambda: "read as the reference reads it" in c.api.log_tail(20000), timeout=10)

        plain = httpx.post(
            c.url + "/generate", json={**KHALA_FRONTEND, "duration": 0.05, "num_tracks": 1}, verify=TLS
        ).json()
        assert plain["adjusted"] == {}
        assert c.wait_job(plain["job_id"])["status"] == "completed"

        r = httpx.post(
            c.url + "/generate", content=b"{not json", headers={"Content-Type": "application/json"}, verify=TLS
        )
        assert r.status_code == 422
        assert r.json()["status"] == "error"
        r = httpx.post(c.url + "/generate", json={"duration": "long"}, verify=TLS)
        assert r.status_code == 422
        assert "duration" in r.json()["error"]

        tags = httpx.get(c.url + "/tags", verify=TLS).json()
        assert set(tag_catalogue.REFERENCE_DEFAULTS) <= {t for g in tags.values() for t in g["tags"]}

        # The worker: seed_override 0 means its own seed (1283 by default), as the reference reads it.
        w = c.workers[0].url
        for sent, used in ((0, 1283), (5, 5)):
            r = httpx.post(
                w + "/generate", json={"duration": 0.02, "lyrics": "x", "seed_override": sent}, timeout=30, verify=TLS
            )
            assert r.status_code == 200, r.text
            assert r.json()["seed"] == used, r.text

        c.api.stop()
        c.start_api("--strict-requests", "true")
        r = httpx.post(c.url + "/generate", json={**body, "lyrics": "x"}, verify=TLS)
        assert r.status_code == 422
        assert r.json()["detail"][0]["loc"][-1] == "duration"


def test_tags_file_replaces_the_catalogue_and_a_bad_one_refuses_start(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"genre_style": {"tags": "Pop"}}')
    port = free_port()
    args = ["backend_api.py", "--port", str(port), "--state-dir", str(tmp_path / "s"), "--num-workers", "0"]
    p = ServerProcess([*args, "--tags-file", str(bad)], port, tmp_path / "bad.log")
    assert p.proc.wait(60) == 2
    lines = p.log_tail().strip().splitlines()
    p.stop()
    assert len(lines) == 1
    assert str(bad) in lines[0]
    assert "'tags'" in lines[0]

    good = tmp_path / "good.json"
    good.write_text(json.dumps({"genre_style": ["Mandopop"], "vocal_instrument": {"label": "Voice", "tags": ["Alto"]}}))
    p = ServerProcess([*args, "--tags-file", str(good)], port, tmp_path / "good.log")
    try:
        p.wait_healthy(want=("ok",))
        assert httpx.get(p.url + "/tags", verify=TLS).json() == {
            "genre_style": {"label": "Genre/Style", "tags": ["Mandopop"]},
            "vocal_instrument": {"label": "Voice", "tags": ["Alto"]},
        }
    finally:
        p.stop()


@pytest.mark.process
def test_launcher_starts_workers_without_a_token_for_a_foreign_dispatcher(tmp_path):
    base = free_port()
    env = {
        **os.environ,
        "WORKER_TOKEN": "off",
        "PIPELINE": "test",
        "CHECKPOINTS_DIR": str(tmp_path),  # configured, so the launcher skips the tiny-set check (unused by a tone)
        "WORKER_BASE_PORT": str(base),
        "BASE_MASTER_PORT": "0",  # no port for the process groups (also the default now)
        "LOG_DIR": str(tmp_path / "logs"),
        "OUTPUT_DIR": str(tmp_path / "audio"),
        "HEALTH_TIMEOUT": "120",
    }
    out = subprocess.run(
        ["bash", "run_backend.sh", "--workers-only", "--no-follow"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    try:
        assert out.returncode == 0, out.stdout + out.stderr
        assert "WORKER_TOKEN is off" in out.stdout
        url = f"http://127.0.0.1:{base}"
        assert httpx.get(url + "/config", verify=TLS).status_code == 200  # no Authorization header needed
        reference_payload = {  # the reference dispatcher's worker body: no task id, no token, no seed
            "genre": "",
            "language": "",
            "tags": "Mandopop",
            "description": "",
            "duration": 0.02,
            "lyrics": "hello",
            "backbone_name": "",
            "superres_name": "",
            "top_k_bb": 80,
            "top_k_sr": 10,
            "temperature": 1.0,
            "superres_text_mode": "same_as_backbone",
            "raw_user_input": "Mandopop",
            "raw_mode": "vocal",
            "raw_prompt_mode": "tags",
        }
        r = httpx.post(url + "/generate", json=reference_payload, timeout=60, verify=TLS)
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "ok", r.text
        assert httpx.get(f"{url}/download/{r.json()['mp3_filename']}", verify=TLS).status_code == 200
    finally:
        subprocess.run(["bash", "run_backend.sh", "stop"], cwd=ROOT, env=env, capture_output=True, timeout=120)
