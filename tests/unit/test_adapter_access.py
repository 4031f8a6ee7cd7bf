"""Who may see, use, upload and delete an uploaded adapter, decided without a server: the fleet's own
adapters are everyone's; an upload is seen only by keys that see its owner's work; a worker's upload the
store no longer has is no one's; only keys with ``upload_adapters`` (and API_KEY, and no keys at all)
may upload; what the sync sends a worker and tells it to drop. Also how a worker's answer to
``PUT /adapters/{name}`` reads, and the body limit of a path under a prefix."""

from __future__ import annotations

import pytest

from songserve.api.jobs.facts import AdapterOffer
from songserve.api.service.adapters import hidden, listing, may_upload, plan_sync
from songserve.api.service.keys import ApiKeys, Caller
from songserve.api.store.adapters import AdapterRecord
from songserve.api.workers.outcomes import AdapterRefused, WorkerFault
from songserve.api.workers.to_worker import read_adapter_answer
from songserve.http.guard import BodyLimit
from songserve.schemas import KeyLimits

STUDIO = Caller("studio", KeyLimits(upload_adapters=True))
OTHER = Caller("other", KeyLimits())
OPERATOR = Caller("ops", KeyLimits(), sees_all=True)
OFFERS = [
    AdapterOffer("house", [0], [], 8, ["linear_qkv"], 100),
    AdapterOffer("mine", [0], [], None, [], None, uploaded=True),
    AdapterOffer("stale", [0], [], None, [], None, uploaded=True),
]
ROWS = {"mine": AdapterRecord("mine", "studio", 4096, "ab" * 32, 4, ["linear_fc1"], 1.0)}


def names(listed):
    return [a["name"] for a in listed]


def test_the_fleets_own_adapters_are_everyones_and_an_upload_its_owners():
    assert names(listing(OFFERS, ROWS, STUDIO)) == ["house", "mine"]
    assert names(listing(OFFERS, ROWS, OTHER)) == ["house"]
    assert hidden(OFFERS, ROWS, OTHER) == {"mine", "stale"}


def test_a_key_that_sees_all_and_a_dispatcher_without_keys_see_every_upload():
    assert names(listing(OFFERS, ROWS, OPERATOR)) == ["house", "mine"]
    assert names(listing(OFFERS, ROWS, None)) == ["house", "mine"]


def test_an_upload_the_store_no_longer_has_is_no_ones():
    assert "stale" in hidden(OFFERS, ROWS, None)
    assert "stale" in hidden(OFFERS, ROWS, OPERATOR)


def test_an_upload_is_listed_with_its_owner_and_what_the_store_knows_of_it():
    mine = listing(OFFERS, ROWS, STUDIO)[1]
    assert (mine["uploaded"], mine["owner"], mine["rank"], mine["targets"], mine["bytes"]) == (
        True,
        "studio",
        4,
        ["linear_fc1"],
        4096,
    )
    assert listing(OFFERS, ROWS, STUDIO)[0]["uploaded"] is False


def test_only_keys_given_upload_adapters_may_upload_and_api_key_and_no_keys_may(tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text('{"k-a": {"name": "a", "upload_adapters": true}, "k-b": {"name": "b"}}')
    known = ApiKeys.load("shared-key", keys)
    assert may_upload(known.identify(b"k-a"))
    assert not may_upload(known.identify(b"k-b"))
    assert may_upload(known.identify(b"shared-key"))
    assert may_upload(None)


def test_a_worker_is_sent_what_it_lacks_or_holds_another_copy_of_and_drops_what_the_store_forgot():
    wanted = {"a": "1", "b": "2", "c": "3"}
    held = {"a": "1", "b": "old", "gone": "9", "coming": "8"}
    assert plan_sync(held, wanted, {}, {"coming"}) == (["b", "c"], ["gone"])


def test_a_copy_a_worker_refused_is_not_sent_again_but_a_new_copy_is():
    wanted = {"a": "1", "b": "2"}
    assert plan_sync({}, wanted, {"a": "1", "b": "old"}, set()) == (["b"], [])


def test_a_workers_refusal_names_the_file_and_its_reason():
    body = {
        "status": "error",
        "error": "Field 'weights': adapter_model.safetensors: holds NaN.",
        "detail": [{"loc": ["body", "weights"], "msg": "adapter_model.safetensors: holds NaN", "type": "value_error"}],
    }
    with pytest.raises(AdapterRefused) as got:
        read_adapter_answer(422, body)
    assert (got.value.field, got.value.reason, got.value.status) == (
        "weights",
        "adapter_model.safetensors: holds NaN",
        422,
    )
    assert read_adapter_answer(200, {"status": "ok", "sha256": "ab"})["sha256"] == "ab"
    with pytest.raises(WorkerFault):
        read_adapter_answer(500, {"error": "boom"})


def test_a_path_under_a_prefix_gets_the_prefixs_body_limit():
    limit = BodyLimit(None, 1000, {"/encode": (5, "audio"), "/adapters/": (7, "adapter")})  # type: ignore[arg-type]
    assert limit.limit("/adapters/house") == (7, "adapter")
    assert limit.limit("/encode") == (5, "audio")
    assert limit.limit("/generate") == (1000, "")
