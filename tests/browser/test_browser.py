"""The page at / in headless Chromium (Debian's package, driven by Playwright): a person's path."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import httpx
import pytest
import soundfile as sf

from tests.support.http import TLS
from tests.support.servers import ROOT, Cluster, wait_for
from tests.support.tiny_site import tiny_site

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = ROOT / "test-artifacts"

# Play the first take's audio until its clock moves past 0.1 s (waited for, not for a fixed time: a
# loaded machine starts playback late), then say where it is and how long it is.
PLAYED_A_LITTLE = """async () => { const a = document.querySelector('.job .result audio'); await a.play();
    for (const t0 = performance.now(); a.currentTime <= 0.1 && performance.now() - t0 < 30000;)
      await new Promise(r => setTimeout(r, 50));
    return [a.currentTime, a.duration]; }"""


@pytest.fixture(scope="module")
def site(shared_tiny, tmp_path_factory):
    # the process's held worker: the backbone waits at a third of a take while holds/hold-1 exists (held_worker.py)
    with tiny_site(shared_tiny, tmp_path_factory.mktemp("browser")) as c:
        yield c


def open_song(page, url: str, lyrics: str, duration: str) -> None:
    """The page at ``url`` with its tag catalogue and earlier jobs loaded, and a one-take song filled in
    (not submitted)."""
    page.goto(url + "/")
    page.wait_for_selector("#tag-chips button")
    page.wait_for_selector("#jobs[data-listed]", state="attached")
    page.fill("#lyrics", lyrics)
    page.fill("#duration", duration)
    page.fill("#num_tracks", "1")


def submitted(page, button: str = "#generate"):
    """Click ``button`` and return the card of the job it made (pinned by id: the list holds older ones)."""
    before = page.locator(".job").count()
    page.click(button)
    page.wait_for_function("(n) => document.querySelectorAll('.job').length > n", arg=before)
    job_id = page.locator(".job").first.get_attribute("data-job-id")
    return page.locator(f'.job[data-job-id="{job_id}"]')


@pytest.fixture(scope="module")
def page():
    if CHROMIUM is None:
        pytest.fail("chromium is not installed: scripts/test installs Debian's chromium package")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM, args=["--autoplay-policy=no-user-gesture-required", "--no-sandbox"]
        )
        yield browser.new_page()
        browser.close()


def test_generate_play_and_cancel_in_the_page(site, page):
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(site.url + "/")
    page.wait_for_selector("#tag-chips button")  # the tag catalogue loaded
    page.wait_for_selector("#jobs[data-listed]", state="attached")  # and the jobs made before
    before = page.locator(".job").count()
    assert page.input_value("#tags").startswith("Mandopop, Female Vocals")  # the reference's default selections
    page.click("#tag-chips button >> nth=0")
    page.fill("#lyrics", "[verse]\nhello browser\nsecond line")
    page.fill("#duration", "0.05")
    page.fill("#num_tracks", "1")
    card = submitted(page)
    card.locator(".track .phase").wait_for()
    audio = card.locator(".result audio")
    audio.wait_for(state="visible", timeout=120_000)
    assert card.locator(".job-status").inner_text().startswith("completed")
    assert card.locator("progress").get_attribute("value") == "100"
    href = card.locator(".dl-wav").get_attribute("href")
    assert href
    assert href.endswith("/track/0/wav")
    played = page.evaluate(PLAYED_A_LITTLE)
    assert played[0] > 0.1
    assert abs(played[1] - 2.97) < 0.2

    # A second, long job: cancel it from its card.
    page.fill("#duration", "15")  # read as 10 minutes, as the reference reads it, and said so on the card
    page.click("#generate")
    page.wait_for_function("(n) => document.querySelectorAll('.job').length === n", arg=before + 2)
    long_card = page.locator(".job").first
    assert long_card.locator(".job-note").inner_text() == (
        "Adjusted: duration 15 → 10. The duration is in minutes; 15 is past the maximum, so the song is 10 minutes."
    )
    long_card.locator(".track .phase").wait_for()
    long_card.locator("button.cancel").click()
    page.wait_for_function(
        "document.querySelector('.job .job-status').textContent.startsWith('cancelled')", timeout=20_000
    )

    # A readable error: more tracks than the server allows.
    page.fill("#num_tracks", "9")
    page.click("#generate")
    err = page.locator("#form-error")
    err.wait_for(state="visible")
    assert "num_tracks" in err.inner_text()
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "browser.png"), full_page=True)
    assert Path(ARTIFACTS / "browser.png").stat().st_size > 10_000
    assert not errors


def test_continue_from_here_and_downloads_in_other_formats(site, page):
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    open_song(page, site.url, "[verse]\nkeep this part\nthen something new", "0.05")
    before = page.locator(".job").count()
    card = submitted(page)
    card.locator(".result audio").wait_for(state="visible", timeout=120_000)
    original = card.get_attribute("data-job-id")
    flac = card.locator(".dl-flac")
    assert flac.get_attribute("href") == f"job/{original}/track/0/render?format=flac"
    card.locator("select.loudness").select_option("-23")
    assert flac.get_attribute("href") == f"job/{original}/track/0/render?format=flac&loudness=-23"
    r = httpx.get(f"{site.url}/{flac.get_attribute('href')}", timeout=60, verify=TLS)
    assert r.status_code == 200
    assert r.headers["content-type"] == "audio/flac"
    assert sf.info(io.BytesIO(r.content)).samplerate == 44100

    # Seek the player to 1.5 s (a person pausing there), then continue from it.
    page.evaluate("""async () => { const a = document.querySelector('.job .result audio'); await a.play(); a.pause();
        await new Promise((done, fail) => { a.addEventListener('seeked', done, { once: true });
          setTimeout(() => fail(new Error('no seeked event')), 20000); a.currentTime = 1.5; }); }""")
    button = card.locator("button.continue")
    assert button.inner_text() == "Continue from 0:01.5"
    button.click()
    page.wait_for_function("(n) => document.querySelectorAll('.job').length === n", arg=before + 2)
    retake = page.locator(".job").first
    retake.locator(".result audio").wait_for(state="visible", timeout=120_000)
    assert retake.locator(".job-title").inner_text().startswith("Mandopop")
    assert " · from 0:01.5" in retake.locator(".job-title").inner_text()
    job = httpx.get(f"{site.url}/job/{retake.get_attribute('data-job-id')}", timeout=10, verify=TLS).json()
    continued = job["tracks"][0]["metadata"]["continued"]
    assert continued["origin"] == f"{original}/0"
    assert continued["frames"] == int(1.5 * 44100 / 2048)
    assert not errors


def new_card(page, button):
    """Click ``button`` and wait for the job card it makes (the newest, first)."""
    before = page.locator(".job").count()
    button.click()
    page.wait_for_function("(n) => document.querySelectorAll('.job').length === n", arg=before + 1)
    return page.locator(".job").first


def take_with_waveform(page, url: str, lyrics: str):
    """A 6 s take made on the page, its waveform drawn and in view: its card, job id and canvas."""
    open_song(page, url, lyrics, "0.1")
    card = submitted(page)
    card.locator(".result audio").wait_for(state="visible", timeout=120_000)
    original = card.get_attribute("data-job-id")
    wave = card.locator("canvas.wave")
    page.wait_for_function(
        "(id) => document.querySelector(`.job[data-job-id='${id}'] canvas.wave`).dataset.drawn === '1'",
        arg=original,
        timeout=30_000,
    )
    wave.scroll_into_view_if_needed()  # the mouse acts on what the viewport shows
    return card, original, wave


def drag(page, wave, a_share: float, b_share: float, shift: bool = False) -> None:
    box = wave.bounding_box()
    assert box is not None
    y = box["y"] + box["height"] / 2
    if shift:
        page.keyboard.down("Shift")
    page.mouse.move(box["x"] + box["width"] * a_share, y)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * (a_share + b_share) / 2, y, steps=5)
    page.mouse.move(box["x"] + box["width"] * b_share, y, steps=5)
    page.mouse.up()
    if shift:
        page.keyboard.up("Shift")


def test_a_part_dragged_on_a_takes_waveform_is_repainted_its_candidates_heard_and_one_kept(site, page):
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    card, original, wave = take_with_waveform(
        page, site.url, "[verse]\nkeep the start\nchange the middle\nkeep the end"
    )
    drag(page, wave, 2 / 6, 4 / 6)  # 2 s to 4 s of the 6 s take
    a, b = (float(x) for x in wave.get_attribute("data-part").split("-"))
    assert abs(a - 2.0) < 0.1
    assert abs(b - 4.0) < 0.1
    button = card.locator("button.repaint")
    assert button.inner_text().startswith("Repaint 0:02")
    page.fill("#num_tracks", "2")
    repaint = new_card(page, button)
    assert " · repaint 0:02" in repaint.locator(".job-title").inner_text()
    repaint.locator(".track").nth(1).locator(".result audio").wait_for(state="visible", timeout=180_000)
    job_id = repaint.get_attribute("data-job-id")
    job = httpx.get(f"{site.url}/job/{job_id}", timeout=10, verify=TLS).json()
    for t in job["tracks"]:
        span = t["metadata"]["repainted"]
        assert span["origin"] == f"{original}/0"
        assert span["start_frame"] == int(a * 44100 / 2048)
    first = repaint.locator(".track").nth(0)
    assert first.locator(".candidate").is_visible()
    first.locator("button.hear").click()
    start, stop = (float(x) for x in first.get_attribute("data-hearing").split("-"))
    assert abs(start - max(0.0, a - 3)) < 0.1
    repaint.locator(".track").nth(1).locator("button.keep").click()
    assert "kept" in (repaint.locator(".track").nth(1).get_attribute("class") or "")
    assert "set-aside" in (first.get_attribute("class") or "")
    page.reload()  # the choice is remembered
    page.wait_for_selector("#jobs[data-listed]", state="attached")
    listed = page.locator(f'.job[data-job-id="{job_id}"]')
    listed.locator(".track").nth(1).locator(".result audio").wait_for(state="visible", timeout=30_000)
    assert "kept" in (listed.locator(".track").nth(1).get_attribute("class") or "")
    assert not errors


def test_two_parts_chosen_with_shift_are_repainted_in_one_request_and_the_start_extended(site, page):
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    card, original, wave = take_with_waveform(page, site.url, "[verse]\ntwo parts change\nthe rest stays")
    drag(page, wave, 0.5 / 6, 1.5 / 6)  # 0.5-1.5 s of the 6 s take
    drag(page, wave, 4 / 6, 5 / 6, shift=True)  # and 4-5 s
    chosen = [[float(x) for x in part.split("-")] for part in wave.get_attribute("data-part").split(",")]
    assert len(chosen) == 2
    for (a, b), (want_a, want_b) in zip(chosen, [(0.5, 1.5), (4.0, 5.0)], strict=True):
        assert abs(a - want_a) < 0.1
        assert abs(b - want_b) < 0.1
    button = card.locator("button.repaint")
    assert button.inner_text().startswith("Repaint 0:00")
    page.fill("#num_tracks", "1")
    repaint = new_card(page, button)
    repaint.locator(".track").nth(0).locator(".result audio").wait_for(state="visible", timeout=180_000)
    job = httpx.get(f"{site.url}/job/{repaint.get_attribute('data-job-id')}", timeout=10, verify=TLS).json()
    parts = job["tracks"][0]["metadata"]["repainted"]["parts"]
    assert len(parts) == 2
    for part, (a, _) in zip(parts, chosen, strict=True):  # data-part is to the hundredth, the request to the ms
        assert abs(part["start_frame"] - a * 44100 / 2048) <= 1
    take = repaint.locator(".track").nth(0)
    hears = take.locator("button.hear")
    assert hears.count() == 2  # one a part
    hears.nth(1).click()
    start, _ = (float(x) for x in take.get_attribute("data-hearing").split("-"))
    assert abs(start - (chosen[1][0] - 3)) < 0.1

    card.locator(".extend-sec").fill("2")
    extended = new_card(page, card.locator("button.extend"))
    assert "2 s more at the start" in extended.locator(".job-title").inner_text()
    extended.locator(".track").nth(0).locator(".result audio").wait_for(state="visible", timeout=180_000)
    job = httpx.get(f"{site.url}/job/{extended.get_attribute('data-job-id')}", timeout=10, verify=TLS).json()
    span = job["tracks"][0]["metadata"]["repainted"]
    assert span["opening"] == round(2 * 44100 / 2048)
    assert span["origin"] == f"{original}/0"
    assert extended.locator(".track").nth(0).locator(".candidate").is_visible()
    assert not errors


def test_the_page_plays_a_take_live_before_it_is_done(site, page):
    """ "Listen live" is on by default: the first take's stream plays while the job is still running."""
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    open_song(page, site.url, "[verse]\nhear it live\nas it is made", "0.5")
    assert page.is_checked("#live")
    hold = site.workers[0].holds / "hold-1"  # the backbone waits at a third of the take until the page has played
    hold.touch()
    try:
        card = submitted(page)
        card.locator(".live .live-badge").wait_for(timeout=60_000)
        # The live <audio> plays (its clock moves) while the job's status is not terminal yet.
        seen = page.wait_for_function(
            """() => { const a = document.querySelector('.job .live audio');
                       const status = document.querySelector('.job .job-status').textContent;
                       return a && a.currentTime > 0.5 && !/^(completed|partial|failed|cancelled)/.test(status)
                         && [a.currentTime, status]; }""",
            timeout=120_000,
            polling=100,
        ).json_value()
    finally:
        hold.unlink()
    assert seen[0] > 0.5
    assert card.locator(".live .live-badge").inner_text() == "LIVE"
    page.wait_for_function(
        "document.querySelector('.job .job-status').textContent.startsWith('completed')", timeout=300_000
    )
    # Done: the final player took the live one's place; the take has one player.
    card.locator(".result audio").wait_for(state="visible")
    assert card.locator(".live").is_hidden()
    assert card.locator(".track audio:visible").count() == 1


PLAYING = "(sel) => { const a = document.querySelector(sel); return a && !a.paused && a.currentTime > 0.2; }"


def test_two_takes_play_one_at_a_time_and_are_listed_again_after_a_reload(site, page):
    """Take 2's "Listen live" pauses take 1; a take nobody hears says how to; done, each take has one
    player; reloaded, the page lists the job with both takes, and each plays. The tiny set's banner."""
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    open_song(page, site.url, "[verse]\ntwo takes\none at a time", "0.5")
    notice = page.locator("#notice")
    notice.wait_for(state="visible", timeout=30_000)  # the tiny set's workers: the listener is told first
    assert notice.inner_text().startswith("Tiny test model: the audio is noise of the right length.")
    assert httpx.get(site.url + "/config", timeout=10, verify=TLS).json()["untrained_workers"] == 1
    page.fill("#num_tracks", "2")
    hold = site.workers[0].holds / "hold-1"  # the backbone waits at a third of a take: both takes still run
    hold.touch()
    try:
        card = submitted(page)
        one, two = card.locator(".track >> nth=0"), card.locator(".track >> nth=1")
        page.wait_for_function(PLAYING, arg=".job .track:nth-child(1) .live audio", timeout=120_000)
        two.locator(".listen").wait_for(state="visible", timeout=60_000)
        assert "press Listen live" in two.locator(".live-sec").inner_text()  # nobody listens: it says how
        two.locator(".listen").click()
        page.wait_for_function(
            """() => { const [a, b] = document.querySelectorAll('.job .live audio');
                       return a.paused && !b.paused; }""",
            timeout=30_000,
        )
    finally:
        hold.unlink()
    page.wait_for_function(
        "document.querySelector('.job .job-status').textContent.startsWith('completed')", timeout=300_000
    )
    for take in (one, two):
        take.locator(".result audio").wait_for(state="visible")
        assert take.locator("audio:visible").count() == 1  # the final player replaced the live one
        assert take.locator(".phase").inner_text() == "ready"
    job_id = card.get_attribute("data-job-id")

    page.reload()
    page.wait_for_selector("#jobs[data-listed]", state="attached")
    listed = page.locator(f'.job[data-job-id="{job_id}"]')
    assert listed.locator(".job-title").inner_text().startswith("Mandopop")
    assert listed.locator(".job-status").inner_text() == "completed"
    assert listed.locator(".result audio").count() == 2
    assert page.locator("#older").is_hidden()  # one page holds every job here
    for i in (1, 2):
        sel = f'.job[data-job-id="{job_id}"] .track:nth-child({i}) .result audio'
        page.evaluate("(sel) => document.querySelector(sel).play()", sel)
        page.wait_for_function(PLAYING, arg=sel, timeout=30_000)
    first = f'.job[data-job-id="{job_id}"] .track:nth-child(1) .result audio'
    assert page.evaluate("(sel) => document.querySelector(sel).paused", first)  # take 2 paused it
    assert listed.locator(".figures summary").first.inner_text() == "details"
    assert "Done" in listed.locator(".figures-text").first.text_content()  # the pipeline's line, one click away
    page.evaluate("() => document.querySelectorAll('audio').forEach((a) => a.pause())")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "page-reloaded.png"), full_page=True)
    assert not errors


def test_docs_render_with_the_network_off(site, page):
    """Swagger UI from the dispatcher itself: every request off this machine is refused, the page renders."""
    browser = page.context.browser
    assert browser is not None
    context = browser.new_context()
    outside: list[str] = []

    def local_only(route):
        if route.request.url.startswith(site.url):
            return route.continue_()
        outside.append(route.request.url)
        return route.abort("internetdisconnected")

    context.route("**/*", local_only)
    docs = context.new_page()
    docs.goto(site.url + "/docs")
    docs.wait_for_selector(".swagger-ui .opblock-summary-path", timeout=60_000)
    paths = docs.locator(".opblock-summary-path").all_inner_texts()
    assert "/generate" in paths
    assert "/jobs" in paths
    ARTIFACTS.mkdir(exist_ok=True)
    docs.screenshot(path=str(ARTIFACTS / "docs-offline.png"), full_page=True)
    assert (ARTIFACTS / "docs-offline.png").stat().st_size > 10_000
    assert outside == []
    context.close()


def test_a_dropped_file_is_uploaded_and_continued_from_a_point_on_its_waveform(site, page, tmp_path):
    import numpy as np

    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    t = np.arange(2 * 48000) / 48000
    demo = tmp_path / "demo.wav"
    sf.write(demo, np.stack([0.3 * np.sin(2 * np.pi * 330 * t) * np.minimum(1, 4 * t)] * 2, 1), 48000)
    open_song(page, site.url, "[verse]\nmy own start\nand what follows", "0.05")
    page.set_input_files("#upload-file", str(demo))
    page.wait_for_function("document.getElementById('upload-status').textContent === 'ready'", timeout=120_000)
    page.wait_for_function("document.getElementById('upload-wave').dataset.drawn === '1'", timeout=20_000)
    box = page.locator("#upload-wave").bounding_box()
    assert box is not None
    page.evaluate("""() => new Promise((done) => { const a = document.getElementById('upload-audio');
        if (a.readyState >= 1) done(); else a.addEventListener('loadedmetadata', done, { once: true }); })""")
    page.locator("#upload-wave").click(position={"x": box["width"] / 2, "y": box["height"] / 2})  # about 1 s in
    page.wait_for_function("document.getElementById('upload-continue').textContent.startsWith('Continue from 0:0')")
    at = round(page.evaluate("document.getElementById('upload-audio').currentTime"), 3)
    assert 0.9 < at < 1.1
    page.wait_for_function(  # the chosen point is marked on the waveform
        """() => { const c = document.getElementById('upload-wave');
                   return c.dataset.marked === document.getElementById('upload-audio').currentTime.toFixed(2); }"""
    )
    card = submitted(page, "#upload-continue")
    card.locator(".result audio").wait_for(state="visible", timeout=120_000)
    assert card.locator(".job-title").inner_text().startswith("demo.wav · from 0:0")
    job = httpx.get(f"{site.url}/job/{card.get_attribute('data-job-id')}", timeout=10, verify=TLS).json()
    continued = job["tracks"][0]["metadata"]["continued"]
    assert continued["origin"].startswith("upload/")
    assert continued["frames"] == int(at * 44100 / 2048)
    assert not errors


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """Behind an API key: a dispatcher with ``--api-key`` over a tone worker."""
    c = Cluster(
        tmp_path_factory.mktemp("keyed"), workers=1, delay=2.0, api_args=("--api-key", "page-key-1"), threads=True
    )
    yield c
    c.stop()


def test_behind_an_api_key_the_page_asks_once_then_plays_follows_and_downloads(keyed, page):
    """The key goes in the Authorization header of the page's calls and, for what cannot send one
    (<audio>, links, EventSource), in its same-site cookie."""
    browser = page.context.browser
    assert browser is not None
    page = browser.new_page()  # its own listeners and storage
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    asked: list[str] = []
    page.on("dialog", lambda d: (asked.append(d.message), d.accept("page-key-1")))
    seen: list[tuple[str, int]] = []
    page.on("response", lambda r: seen.append((r.url.split("/", 3)[-1], r.status)))
    open_song(page, keyed.url, "[verse]\nbehind a key", "0.05")
    card = submitted(page)
    audio = card.locator(".result audio")
    audio.wait_for(state="visible", timeout=60_000)
    played = page.evaluate(PLAYED_A_LITTLE)
    assert played[0] > 0.1
    assert played[1] > 2
    assert card.locator(".job-status").inner_text().startswith("completed")
    assert asked == ["This server needs an API key:"]  # once
    wait_for(lambda: any(u.endswith("/events") and code == 200 for u, code in seen), timeout=10)  # followed live
    href = card.locator(".dl-wav").get_attribute("href")
    assert page.evaluate("(href) => fetch(href).then((r) => r.status)", href) == 200  # no header: the cookie
    assert [code for _, code in seen].count(401) == 1  # the page's first call, before it had the key
    assert keyed.workers  # tone workers, which do not say they run an untrained set: no banner
    assert page.locator("#notice").is_hidden()
    assert (
        httpx.get(keyed.url + "/config", headers={"Authorization": "Bearer page-key-1"}, verify=TLS).json()["notice"]
        is None
    )
    assert not errors
    page.close()


# Every control of the page with no name a person with a screen reader (or getByLabel) could find it by.
UNNAMED_CONTROLS = """() => [...document.querySelectorAll('input, textarea, select, audio, canvas, button')]
    .filter((el) => !(el.labels && el.labels.length) && !el.getAttribute('aria-label')
      && !el.getAttribute('aria-labelledby') && !(el.tagName === 'BUTTON' && el.textContent.trim()))
    .map((el) => el.id || el.className || el.tagName)"""


def test_the_page_says_what_to_do_first_offers_a_short_song_on_cpus_and_keeps_the_form_over_a_reload(site, page):
    browser = page.context.browser
    assert browser is not None
    context = browser.new_context()  # nothing kept from the tests before
    page = context.new_page()
    page.goto(site.url + "/")
    page.wait_for_selector("#tag-chips button")
    assert "press Generate" in page.locator("#first-step").inner_text()
    # The shared worker runs the tiny set on the CPU (its /config says "cpu"): a short song first.
    page.wait_for_function("document.querySelector('#duration').value === '0.5'")
    page.get_by_label("Lyrics").fill("[verse]\nkept across a reload")
    page.click("#tag-chips button >> nth=1")
    page.fill("#duration", "0.07")
    page.fill("#num_tracks", "1")
    page.fill("#seed", "42")
    page.uncheck("#live")
    kept = {sel: page.input_value(sel) for sel in ("#lyrics", "#tags", "#duration", "#num_tracks", "#seed")}
    page.reload()
    page.wait_for_selector("#tag-chips button")
    page.wait_for_selector("#jobs[data-listed]", state="attached")
    assert {sel: page.input_value(sel) for sel in kept} == kept
    assert not page.is_checked("#live")
    assert page.input_value("#duration") == "0.07"  # the person's choice stays over the CPU default
    # A finished take: its player shows its length before it is played, and every control has a name.
    card = submitted(page)
    audio = card.locator(".result audio")
    audio.wait_for(state="visible", timeout=60_000)
    page.wait_for_function("(a) => a.duration > 0 && a.paused", arg=audio.element_handle(), timeout=30_000)
    assert audio.get_attribute("aria-label") == "Take 1"
    assert page.evaluate(UNNAMED_CONTROLS) == []
    context.close()


def test_a_loudness_a_take_cannot_reach_is_said_beside_its_download_links(site, page):
    from tests.support.audio import spiky

    open_song(page, site.url, "[verse]\ntoo spiky to be loud", "0.05")
    card = submitted(page)
    card.locator(".result audio").wait_for(state="visible", timeout=60_000)
    job_id = card.get_attribute("data-job-id")
    spiky(site.tmp / "state" / "results" / job_id / "track_0.wav")
    card.locator(".loudness").select_option("-14")
    with page.expect_download():
        card.locator(".dl-flac").click()
    note = card.locator(".render-note")
    note.wait_for(state="visible", timeout=30_000)
    assert note.inner_text().startswith("Reached -")
    assert "LUFS, not -14: any louder would clip" in note.inner_text()


def test_behind_an_api_key_a_wrong_key_is_said_wrong_and_a_dismissed_prompt_says_the_key_is_missing(keyed, page):
    browser = page.context.browser
    assert browser is not None
    for answers, header in (
        (["wrong-key", None], "The API key given was not accepted; reload the page to enter the right one."),
        ([None], "This server needs an API key and none was given; reload the page to enter it."),
    ):
        context = browser.new_context()
        p = context.new_page()
        asked: list[str] = []
        left = list(answers)

        def answer(d, asked=asked, left=left):
            asked.append(d.message)
            given = left.pop(0) if left else None
            d.accept(given) if given else d.dismiss()

        p.on("dialog", answer)
        p.goto(keyed.url + "/")
        status = p.locator("#server-status")
        p.wait_for_function("!document.querySelector('#server-status').textContent.startsWith('connecting')")
        p.wait_for_selector("#jobs[data-listed]", state="attached")
        assert status.inner_text().startswith(header), status.inner_text()
        assert "unreachable" not in status.inner_text()
        expected = ["This server needs an API key:"]
        if len(answers) == 2:
            expected.append("The API key given was not accepted (wrong, or no longer valid). Enter the right key:")
        assert asked == expected  # and not asked again by the page's own refreshes
        context.close()


@pytest.fixture(scope="module")
def lora_site(tiny_dir, tmp_path_factory):
    """A dispatcher over a tiny-set worker with the tiny adapter set in its ADAPTERS_DIR."""
    from songserve.pipeline.tiny.adapters import write_tiny_adapters
    from songserve.pipeline.tiny.build import tiny_arch
    from tests.support.servers import cluster_of, start_worker

    tmp = tmp_path_factory.mktemp("browser_lora")
    folder = write_tiny_adapters(tmp / "adapters", {k: tiny_arch(k, 1024) for k in ("backbone", "superres")})
    worker = start_worker(tmp, "--runtime-mode", "keep_loaded", "--adapters-dir", str(folder), name="lora")
    c = cluster_of(tmp, [worker])
    yield c
    c.stop()


def test_the_form_offers_the_fleets_adapters_and_a_take_is_made_on_the_one_chosen(lora_site, page):
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    open_song(page, lora_site.url, "[verse]\nin the studio's sound", "0.05")
    page.wait_for_function("document.getElementById('adapter').dataset.listed === '4'", timeout=30_000)
    assert page.locator("#adapter option").all_inner_texts() == [
        "none (the base model)",
        "tiny-a",
        "tiny-b",
        "tiny-c",
        "tiny-sr",
    ]
    page.select_option("#adapter", "tiny-b")
    page.fill("#adapter_scale", "0.7")
    card = submitted(page)
    card.locator(".result audio").wait_for(state="visible", timeout=120_000)
    job = httpx.get(f"{lora_site.url}/job/{card.get_attribute('data-job-id')}", timeout=10, verify=TLS).json()
    assert job["tracks"][0]["metadata"]["adapter"] == {"name": "tiny-b", "scale": 0.7, "rank": 4}
    assert not errors
