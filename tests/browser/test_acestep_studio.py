"""ACE-Step's own Studio page, unchanged, against songserve's ACE-Step port, in headless Chromium.

The page (tests/fixtures/acestep/studio.html, ACE-Step-1.5's ``ui/studio.html`` byte for byte; its
licence beside it) is served from a local origin, as docs/integrations.md tells a person to serve it; it calls
the dispatcher's ``--acestep-port`` across origins (CORS), polls ``/query_result`` and puts one
``<audio>`` per take. The API base URL is typed into its field, as a person would.
"""

from __future__ import annotations

import functools
import hashlib
import shutil
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.support.servers import ROOT, Cluster, free_port

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FIXTURE = ROOT / "tests" / "fixtures" / "acestep"
UPSTREAM_BLOB = "4188aedbd2d2b4706b50379d11eb51ef6d10ef97"  # ui/studio.html at ACE-Step-1.5 f30aee4c


class Quiet(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def page_origin() -> Iterator[str]:
    """The fixture folder on a local origin (``python -m http.server`` in a thread)."""
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), functools.partial(Quiet, directory=str(FIXTURE)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    port = free_port()
    c = Cluster(
        tmp_path_factory.mktemp("studio"), workers=2, delay=0.3, api_args=("--acestep-port", str(port)), threads=True
    )
    c.ace = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    yield c
    c.stop()


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.fail("chromium is not installed: scripts/test installs Debian's chromium package")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(
            executable_path=CHROMIUM, args=["--autoplay-policy=no-user-gesture-required", "--no-sandbox"]
        )
        yield b
        b.close()


def test_the_vendored_page_is_acesteps_unchanged():
    data = (FIXTURE / "studio.html").read_bytes()
    assert hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == UPSTREAM_BLOB
    assert "MIT License" in (FIXTURE / "LICENSE").read_text()


def test_generate_in_acesteps_studio_shows_one_playable_audio_per_take(site, page_origin, browser):
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(page_origin + "/studio.html")
    page.fill("#apiBase", site.ace + "/")  # the page trims the slash
    page.fill("#prompt", "pop, piano")
    page.fill("#lyrics", "[verse]\nhello studio\nsecond line")
    page.fill("#audioDuration", "10")  # the page sends 10–600 s only
    page.fill("#batchSize", "2")
    assert page.is_checked("#thinking")  # its default: ignored here (listed in the answer's extra)
    page.click("#submitBtn")
    page.wait_for_function("document.querySelectorAll('#results audio').length === 2", timeout=120_000)
    log = page.inner_text("#log")
    assert "Task ID: " in log
    assert "Done." in log
    assert page.locator("#log .error").count() == 0
    assert page.locator(".result-item strong").all_inner_texts() == ["Pop, Piano", "Pop, Piano"]
    metas = page.locator(".result-item .meta").all_inner_texts()  # the take's length: "9.99s"
    assert len(metas) == 2
    assert all(m.endswith("s") and abs(float(m[:-1]) - 10.0) < 0.05 for m in metas)
    played = page.evaluate(
        """async () => Promise.all([...document.querySelectorAll('#results audio')].map(async a => {
             await a.play();  // it plays: its clock moves (waited for, not for a fixed time: a loaded machine)
             for (const t0 = performance.now(); a.currentTime <= 0.1 && performance.now() - t0 < 30000;)
               await new Promise(r => setTimeout(r, 50));
             a.pause();
             return [a.currentTime, a.duration, a.currentSrc]; }))"""
    )
    for current, duration, src in played:
        assert current > 0.1
        assert abs(duration - 10.0) < 0.2
        assert src.startswith(site.ace + "/v1/audio?path=")
    task_id = log.split("Task ID: ", 1)[1].split()[0]
    assert site.job(task_id)["status"] == "completed"  # a task is a job on our port
    (ROOT / "test-artifacts").mkdir(exist_ok=True)
    page.screenshot(path=str(ROOT / "test-artifacts" / "acestep-studio.png"), full_page=True)
    assert not errors
    page.close()
