"""Live audio of a tiny-set take, through a real dispatcher and a real model worker.

The proofs on the model: the streamed WAV decodes, grows while the track is generating, ends
at the take's end with the length of the final (its preview covers every frame; what a preview
lacks would come from the final file); the final WAV is byte-identical with and without a
listener for the same seed; the preview is audio of the same song (its spectrum close to the
final's, measured in ``bench/p14_live.py``).
"""

from __future__ import annotations

import io
import threading

import httpx
import numpy as np
import pytest
import soundfile as sf

from tests.support.http import TLS
from tests.support.servers import Cluster, wait_for
from tests.support.tiny_site import tiny_site

SONG = {"tags": "pop, piano", "lyrics": "[verse]\nhear it\nas it is made", "duration": 0.5, "num_tracks": 1, "seed": 21}
WAIT = 600.0


@pytest.fixture(scope="module")
def site(shared_tiny, tmp_path_factory):
    with tiny_site(shared_tiny, tmp_path_factory.mktemp("live_model")) as c:
        yield c  # the process's held worker (tests/support/held_worker.py), with 2 s preview windows


def post(site: Cluster) -> str:
    r = httpx.post(f"{site.url}/generate", json=SONG, timeout=30, verify=TLS)
    assert r.status_code == 200, r.text
    return str(r.json()["job_id"])


def test_a_listener_hears_the_take_while_it_is_made_and_changes_nothing_in_it(site):
    quiet = site.wait_job(post(site), timeout=WAIT)  # nobody listens
    assert quiet["status"] == "completed"
    assert "live" not in quiet["tracks"][0]["metadata"]

    # The backbone waits at a third and at two thirds of the take while hold files exist (held_worker.py):
    # the test lets it go on only once audio has come while the track is generating, so the proof
    # does not depend on how the preview thread and the backbone share this machine's cores.
    holds = [site.workers[0].holds / f"hold-{k}" for k in (1, 2)]
    for hold in holds:
        hold.touch()
    job = post(site)
    body, during = bytearray(), []  # audio bytes, and how many had come while the track was generating

    def listen() -> None:
        with httpx.stream(
            "GET", f"{site.url}/job/{job}/track/0/stream?format=wav", timeout=httpx.Timeout(10, read=300), verify=TLS
        ) as r:
            assert r.status_code == 200
            for piece in r.iter_raw(1 << 15):
                body.extend(piece)

    t = threading.Thread(target=listen, daemon=True)
    t.start()

    def more_while_generating(had: int) -> bool:
        return site.job(job)["tracks"][0]["status"] == "generating" and len(body) > max(had, 44)

    for hold in holds:
        had = len(body)
        wait_for(lambda had=had: more_while_generating(had), timeout=300)
        during.append(len(body))
        hold.unlink()
    heard = site.wait_job(job, timeout=WAIT)
    t.join(60)
    assert not t.is_alive()
    assert heard["status"] == "completed"
    live = heard["tracks"][0]["metadata"]["live"]
    assert live["state"] == "complete"
    assert live["windows"] >= 2

    # Audio came while the backbone was still writing, and more of it as it went on.
    assert during[-1] > during[0] > 44

    wav = httpx.get(f"{site.url}/job/{job}/track/0/wav", timeout=30, verify=TLS).content
    final, rate = sf.read(io.BytesIO(wav), dtype="int16")
    streamed = np.frombuffer(bytes(body[44:]), dtype="<i2").reshape(-1, 2)
    assert rate == 44_100
    assert len(streamed) == len(final)  # from its start to its end: every frame of the take
    assert live["seconds"] == pytest.approx(len(final) / rate, abs=0.01)  # all of it made live
    assert not np.array_equal(streamed, final)  # a preview, not the final: its own super-resolution draws

    # The final WAV is what it is without a listener: same seed, same bytes.
    assert wav == httpx.get(f"{site.url}/job/{quiet['job_id']}/track/0/wav", timeout=30, verify=TLS).content
    wait_for(lambda: not list(site.workers[0].audio.glob("*.live.pcm")), timeout=10)  # nothing left behind
