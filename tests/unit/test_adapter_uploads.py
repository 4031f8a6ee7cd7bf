"""Uploaded adapters on a worker (``residency.AdapterStore.upload``/``remove``): an upload is checked as a
folder adapter is at load, kept under its name with its weights' SHA-256, listed beside the operator's
folder, replaces one of its name (dropping the resident copy) and is removed on request; a refused one
names the file and the reason and leaves nothing behind."""

from __future__ import annotations

import hashlib
import io
import math

import pytest
import torch

from songserve.errors import ConflictError, FieldError, NotFoundError
from songserve.pipeline.adapters.format import CONFIG, WEIGHTS
from songserve.pipeline.adapters.residency import AdapterStore, model_shape
from songserve.pipeline.adapters.safetensors_file import read_safetensors, write_safetensors
from songserve.pipeline.tiny.adapters import write_tiny_adapters
from songserve.pipeline.tiny.build import tiny_arch

ARCHS = {k: tiny_arch(k, 1024) for k in ("backbone", "superres")}
SHAPES = {k: model_shape(a) for k, a in ARCHS.items()}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_adapters(tmp_path_factory.mktemp("adapters") / "adapters", ARCHS)


@pytest.fixture
def store(tiny, tmp_path):
    return AdapterStore(tiny, 2, SHAPES, {"tiny"}, uploads=tmp_path / "uploads")


def files(folder):
    return io.BytesIO((folder / CONFIG).read_bytes()), io.BytesIO((folder / WEIGHTS).read_bytes())


def weights_with(folder, tmp_path, edit):
    tensors = read_safetensors(folder / WEIGHTS)
    edit(tensors)
    write_safetensors(tmp_path / "w.safetensors", tensors)
    return io.BytesIO((folder / CONFIG).read_bytes()), io.BytesIO((tmp_path / "w.safetensors").read_bytes())


def leftovers(store):
    return sorted(p.name for p in store.uploads.iterdir()) if store.uploads.exists() else []


def test_an_upload_is_listed_beside_the_folder_with_its_sha256_and_loads(store, tiny):
    said = store.upload("mine", *files(tiny / "tiny-a"))
    digest = hashlib.sha256((tiny / "tiny-a" / WEIGHTS).read_bytes()).hexdigest()
    assert said["sha256"] == digest
    assert said["name"] == "mine"
    assert said["rank"] == 8
    assert store.uploaded() == {"mine": digest}
    assert "mine" in store.available()
    assert "tiny-a" in store.available()
    assert store.get("mine").adapter.rank == 8
    assert leftovers(store) == ["mine"]
    assert store.describe()["uploaded"] == {"mine": digest}


def test_a_worker_started_later_reads_its_uploads_back(store, tiny):
    store.upload("mine", *files(tiny / "tiny-b"))
    again = AdapterStore(tiny, 2, SHAPES, {"tiny"}, uploads=store.uploads)
    assert again.uploaded() == store.uploaded()


def test_replacing_an_upload_drops_its_resident_copy_and_the_next_load_reads_the_new_files(store, tiny):
    store.upload("mine", *files(tiny / "tiny-a"))
    first = store.get("mine")
    store.upload("mine", *files(tiny / "tiny-c"))
    assert "mine" not in store.resident()
    second = store.get("mine")
    assert second.key != first.key
    assert second.adapter.targets != first.adapter.targets
    assert leftovers(store) == ["mine"]


def test_removing_an_upload_forgets_it_and_a_second_removal_is_not_found(store, tiny):
    store.upload("mine", *files(tiny / "tiny-a"))
    store.get("mine")
    store.remove("mine")
    assert "mine" not in store.available()
    assert "mine" not in store.resident()
    assert store.uploaded() == {}
    assert leftovers(store) == []
    with pytest.raises(NotFoundError):
        store.remove("mine")


def test_a_removal_for_one_copy_removes_that_copy_only(store, tiny):
    first = store.upload("mine", *files(tiny / "tiny-a"))["sha256"]
    second = store.upload("mine", *files(tiny / "tiny-b"))["sha256"]  # sent later, by another dispatcher
    with pytest.raises(ConflictError, match="sha256.*kept"):
        store.remove("mine", first)
    assert store.uploaded() == {"mine": second}
    assert leftovers(store) == ["mine"]
    store.remove("mine", second)
    assert store.uploaded() == {}
    assert leftovers(store) == []


def test_the_operators_adapters_are_never_replaced_nor_removed(store, tiny):
    with pytest.raises(ConflictError, match="ADAPTERS_DIR"):
        store.upload("tiny-a", *files(tiny / "tiny-b"))
    with pytest.raises(NotFoundError):
        store.remove("tiny-a")
    assert (tiny / "tiny-a" / WEIGHTS).is_file()


def nan(tensors):
    key = next(iter(tensors))
    tensors[key] = torch.full_like(tensors[key], math.nan)


def wrong_shape(tensors):
    key = next(k for k in tensors if k.endswith("lora_A.weight"))
    tensors[key] = torch.zeros(tensors[key].shape[0], tensors[key].shape[1] + 1)


@pytest.mark.parametrize(
    ("make", "field", "reason"),
    [
        (lambda t, p: weights_with(t, p, nan), "weights", "NaN"),
        (lambda t, p: weights_with(t, p, wrong_shape), "weights", "this model needs"),
        (
            lambda t, p: (io.BytesIO((t / CONFIG).read_bytes()), io.BytesIO(b"not safetensors")),
            "weights",
            "safetensors",
        ),
        (
            lambda t, p: (io.BytesIO((t / CONFIG).read_bytes().replace(b'"tiny"', b'"other-model"')), files(t)[1]),
            "config",
            "base model",
        ),
        (lambda t, p: (io.BytesIO(b"{"), files(t)[1]), "config", "JSON"),
    ],
    ids=["nan", "shapes", "not-safetensors", "base-model", "config-not-json"],
)
def test_a_bad_upload_names_the_file_and_the_reason_and_leaves_nothing(store, tiny, tmp_path, make, field, reason):
    with pytest.raises(FieldError) as got:
        store.upload("bad", *make(tiny / "tiny-a", tmp_path))
    assert got.value.detail is not None
    assert got.value.detail[0]["loc"] == ["body", field]
    assert reason in str(got.value)
    assert str(store.uploads) not in str(got.value)
    assert leftovers(store) == []
    assert store.uploaded() == {}
    assert "bad" not in store.available()


def test_a_name_that_is_not_an_adapter_name_is_refused(store, tiny):
    with pytest.raises(FieldError, match="name"):
        store.upload("../x", *files(tiny / "tiny-a"))
