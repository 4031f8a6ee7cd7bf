"""Our worker driven the way the reference's dispatcher drives its workers (backend/backend_api.py).

Its request body (whole-minute duration, empty genre and language, its superres text mode, a seed
of the worker's seed plus an offset), its polling of /health while the request runs (the phase line
parses progress_detail with its own regular expression), its /download calls, and no token.
"""

from __future__ import annotations

import re
import threading

import httpx

from tests.support.http import TLS
from tests.support.tiny_site import lent

REFERENCE_TOKENS = re.compile(r"^\s*(\d+)\s*/\s*\d+\s+tokens\s*$")  # the reference dispatcher's pattern


def test_a_reference_style_dispatcher_completes_a_track_on_our_worker(shared_tiny):
    with lent(shared_tiny) as w:  # the process's tiny-model worker: keep_loaded, no WORKER_TOKEN (support/tiny_site.py)
        health = w.health()
        body = {
            "genre": "",
            "language": "",
            "tags": "Pop, Piano",
            "description": "",
            "duration": 1,
            "lyrics": "hello world\nsecond line",
            "backbone_name": "",
            "superres_name": "",
            "top_k_bb": 80,
            "top_k_sr": 10,
            "temperature": 1.0,
            "superres_text_mode": "same_as_backbone_no_description",
            "raw_user_input": "Pop, Piano",
            "raw_mode": "vocal",
            "raw_prompt_mode": "tags",
            "seed_override": int(health["seed"]) + 1,
        }
        seen: list[dict] = []
        done = threading.Event()

        def poll() -> None:
            with httpx.Client(timeout=5, verify=TLS) as c:
                while not done.is_set():
                    seen.append(c.get(w.url + "/health").json())
                    done.wait(0.1)

        poller = threading.Thread(target=poll)
        poller.start()
        try:
            r = httpx.post(w.url + "/generate", json=body, timeout=600, verify=TLS)
        finally:
            done.set()
            poller.join()
        result = r.json()
        assert r.status_code == 200, r.text
        assert result["status"] == "ok"
        assert result["seed"] == body["seed_override"]
        details = [h["progress_detail"] for h in seen if h["phase"] == "backbone" and h["progress_detail"]]
        assert details, "no backbone progress was seen"
        assert all(REFERENCE_TOKENS.match(d) for d in details), details[:3]
        assert any(h.get("tokens_per_sec") for h in seen if h["phase"] == "backbone")
        for name, media in ((result["mp3_filename"], "audio/mpeg"), (result["wav_filename"], "audio/wav")):
            got = httpx.get(f"{w.url}/download/{name}", timeout=30, verify=TLS)
            assert got.status_code == 200
            assert got.headers["content-type"].startswith(media)
            assert len(got.content) > 1000
        assert abs(result["duration_sec"] - 60.0) < 1.0  # the tiny set keeps the requested length
