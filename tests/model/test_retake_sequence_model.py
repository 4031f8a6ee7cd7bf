"""Retakes and continuations one after another on one real tiny-model worker, through a real dispatcher.

Generate, retake, continue an upload, continue the same upload again: when restoring a KV snapshot that is
not the LRU's first slot compares the slots' tensors, the last one fails ("The task failed inside the model
(RuntimeError)") and so does every retake on that worker after it. Here every
one of those jobs, and retakes of the first take after them (its slot no longer first), completes;
the continuations restore their own snapshots and the worker reports no fault in its cache.
"""

from __future__ import annotations

import httpx
import pytest

from tests.support.audio import music, wav_bytes
from tests.support.http import TLS
from tests.support.servers import Cluster, wait_for
from tests.support.tiny_site import tiny_site

WAIT = 600.0  # seconds: generous, the machine is shared
SONG = {"tags": "pop, piano", "lyrics": "[verse]\nagain and again", "duration": 0.2, "num_tracks": 1}


@pytest.fixture(scope="module")
def site(shared_tiny, tmp_path_factory):
    with tiny_site(shared_tiny, tmp_path_factory.mktemp("retake_sequence")) as c:
        yield c  # the process's tiny-model worker, its KV snapshots cleared


def run(site: Cluster, **body) -> dict:
    r = httpx.post(f"{site.url}/generate", json=body, timeout=30, verify=TLS)
    assert r.status_code == 200, r.text
    done = site.wait_job(r.json()["job_id"], timeout=WAIT)
    assert done["status"] == "completed", done
    return dict(done["tracks"][0])


def upload(site: Cluster) -> str:
    data = wav_bytes(music(4.0))
    r = httpx.post(f"{site.url}/uploads", files={"file": ("demo.wav", data, "audio/wav")}, timeout=60, verify=TLS)
    assert r.status_code == 200, r.text
    upload_id = str(r.json()["upload_id"])
    view = wait_for(
        lambda: (
            (v := httpx.get(f"{site.url}/uploads/{upload_id}", timeout=10, verify=TLS).json())["status"]
            not in ("queued", "encoding")
            and v
        ),
        timeout=WAIT,
    )
    assert view["status"] == "ready", view
    return upload_id


def test_generate_retake_and_continue_an_upload_twice_all_complete(site):
    first = run(site, **SONG, seed=1)
    job0 = first["files"]["codes"].split("/")[2]
    retake = {"job_id": job0, "track_index": 0, "at_sec": 5.0}
    a = run(site, continue_from=retake, num_tracks=1, seed=2)
    assert a["metadata"]["prefill"]["restored"] == 0  # nothing kept yet: prefilled, and kept as a slot

    upload_id = upload(site)
    cont = {
        "continue_from": {"upload_id": upload_id},
        "tags": "jazz",
        "lyrics": "[verse]\non and on",
        "duration": 0.2,
        "num_tracks": 1,
    }
    u1 = run(site, **cont, seed=3)
    tokens = u1["metadata"]["prefill"]["tokens"]
    assert u1["metadata"]["continued"]["origin"] == f"upload/{upload_id}"
    u2 = run(site, **cont, seed=4)  # its snapshot is the LRU's second slot: this one failed before
    assert (u2["metadata"]["prefill"]["tokens"], u2["metadata"]["prefill"]["restored"]) == (tokens, tokens)

    b = run(site, continue_from=retake, num_tracks=1, seed=5)  # the retake's slot is first again, then not
    c = run(site, continue_from={**retake, "at_sec": 3.0}, num_tracks=1, seed=6)
    u3 = run(site, **cont, seed=7)
    assert b["metadata"]["prefill"]["restored"] == b["metadata"]["prefill"]["tokens"]
    assert c["metadata"]["prefill"]["restored"] == c["metadata"]["prefill"]["tokens"] - 1  # cut to 3 s
    assert u3["metadata"]["prefill"]["restored"] == tokens

    snaps = httpx.get(f"{site.workers[0].url}/health", timeout=10, verify=TLS).json()["kv_snapshots"]
    assert snaps["faults"] == 0
    assert {s["origin"] for s in snaps["slots"]} == {f"{job0}/0", f"upload/{upload_id}"}
