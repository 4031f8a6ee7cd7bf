"""LoRA adapters through a real dispatcher over HTTP, what the dispatcher decides alone: a take naming an
adapter no worker can load is refused before any work, naming the field; ``GET /adapters`` says what the
fleet offers (tone workers offer none). The model's side, with real adapters on the tiny set, is
``tests/model/test_adapters*.py`` and ``tests/process/test_adapters_fleet.py``."""

from __future__ import annotations

import httpx
import pytest

from tests.support.http import TLS
from tests.support.servers import Cluster


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("adapters"), workers=1, delay=0.05, threads=True)
    yield c
    c.stop()


def test_a_fleet_of_tone_workers_offers_no_adapter(site):
    r = httpx.get(f"{site.url}/adapters", timeout=10, verify=TLS)
    assert r.status_code == 200
    assert r.json() == {"adapters": []}


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({"adapter": "studio-a"}, "adapter", "no worker here can load adapter 'studio-a'"),
        ({"num_tracks": 2, "takes": [{"adapter": None}, {"adapter": "x"}]}, "takes.1.adapter", "adapter 'x'"),
        ({"adapter": "../etc"}, "adapter", "pattern"),
        ({"adapter": "a", "adapter_scale": 5}, "adapter_scale", "less than or equal to 4"),
        ({"adapter_scale": "NaN"}, "adapter_scale", "finite"),
        ({"num_tracks": 2, "takes": [{"adapter": None}]}, "", "takes has 1 entries for 2 takes"),
        ({"takes": [{"adapter": None, "surprise": 1}], "num_tracks": 1}, "takes.0.surprise", "Extra inputs"),
    ],
)
def test_an_adapter_no_worker_can_load_or_a_bad_choice_is_a_422_naming_the_field_and_queues_nothing(
    site, body, field, words
):
    before = httpx.get(f"{site.url}/status", timeout=10, verify=TLS).json()["tracks_by_status"]
    r = httpx.post(f"{site.url}/generate", json={"tags": "pop", "lyrics": "la", **body}, timeout=10, verify=TLS)
    assert r.status_code == 422, r.text
    answer = r.json()
    assert any(".".join(str(x) for x in d["loc"][1:]) == field for d in answer["detail"]), answer
    assert words in r.text
    assert httpx.get(f"{site.url}/status", timeout=10, verify=TLS).json()["tracks_by_status"] == before


def test_scale_zero_or_no_adapter_is_the_base_model_and_is_served(site):
    r = httpx.post(
        f"{site.url}/generate",
        json={"tags": "pop", "lyrics": "la", "duration": 0.05, "num_tracks": 1, "takes": [{"adapter": None}]},
        timeout=10,
        verify=TLS,
    )
    assert r.status_code == 200, r.text
    assert site.wait_job(r.json()["job_id"])["status"] == "completed"
