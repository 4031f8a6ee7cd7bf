"""Unknown request fields: answered to the client, bounded, never stored, never held, logged only escaped.

Unbounded and unescaped, they cost +324 MB of dispatcher memory after 90 requests of 3.5 MB of unknown names
(a set that only grew), 889 KB of them stored with each job, and a name holding a newline forged
a log line. The in-process tests pin the pieces (``body_fields``, ``normalize``, ``logs``); the
last test sends 100 bodies of 20,000 unknown names each to a real dispatcher and measures.
"""

from __future__ import annotations

import json
import logging
import re
import sqlite3
from pathlib import Path

import httpx
import psutil
import pytest

from songserve.api.service.requests import RequestLimits, normalize
from songserve.process.logs import MAX_MESSAGE_CHARS, LineFormatter, safe
from songserve.schemas import GenerateRequest
from songserve.schemas.body_fields import MAX_NAME_CHARS, MAX_NAMES, read_body, suggestion
from tests.support.http import TLS
from tests.support.servers import ServerProcess, free_port

FORGED = "2031-01-01 00:00:00,000 ERROR api songserve.api.service.job_service: forged"


def probe_body(i: int, names: int = 20_000) -> dict[str, object]:
    """A request whose unknown names are long, many, and try to forge log lines."""
    body: dict[str, object] = {f"x{i}-{k:05d}\n{FORGED} {k}" + "y" * 60: k for k in range(names)}
    body.update(lyrics="hello\nworld", duration=0.05, num_tracks=1)
    return body


@pytest.mark.quick
def test_unknown_names_are_collected_bounded_and_in_body_order():
    body = {**probe_body(0, 20_000), "lyric": "x"}
    got = read_body(body, GenerateRequest.model_fields)
    assert got.unknown.count == 20_001
    assert len(got.unknown.names) == MAX_NAMES
    assert all(len(n) <= MAX_NAME_CHARS for n in got.unknown.names)
    assert got.unknown.names[0].startswith("x0-00000\n")
    assert got.unknown.left_out == 20_001 - MAX_NAMES
    assert set(got.sent) == {"lyrics", "duration", "num_tracks"}
    assert read_body([1, 2], GenerateRequest.model_fields).unknown.count == 0  # not an object: nothing to report


@pytest.mark.quick
@pytest.mark.parametrize(
    ("name", "meant"),
    [("lyric", "lyrics"), ("durration", "duration"), ("Lyrics", "lyrics"), ("num_track", "num_tracks"), ("xyz", None)],
)
def test_a_misspelled_field_is_matched_to_the_one_it_misspells(name, meant):
    assert suggestion(name, GenerateRequest.model_fields) == meant


@pytest.mark.quick
def test_the_normalized_request_keeps_nothing_of_the_unknown_names():
    req = GenerateRequest.model_validate({"lyric": "x", "durration": 2, "tags": "pop", "z" * 500: {"deep": [1] * 9}})
    norm = normalize(req, RequestLimits())
    assert norm.ignored == ["lyric", "durration", "z" * MAX_NAME_CHARS]
    assert norm.unknown_count == 3
    assert "'lyric' is not a field and was ignored; did you mean 'lyrics'?" in norm.notes
    assert "'durration' is not a field and was ignored; did you mean 'duration'?" in norm.notes
    assert any("vocal without words" in n for n in norm.notes)  # and the lyrics it meant to send are not there
    stored = norm.request.model_dump_json()
    assert 'lyric"' not in stored
    assert "durration" not in stored
    assert "zzz" not in stored
    assert norm.request.body.unknown.count == 0  # the job's request holds neither names nor values as sent
    assert norm.request.body.sent == {}
    assert norm.request.model_extra in (None, {})


@pytest.mark.quick
def test_an_empty_body_is_said_to_be_all_defaults():
    norm = normalize(GenerateRequest.model_validate({}), RequestLimits())
    assert norm.ignored == []
    assert any("none of the known fields" in n for n in norm.notes)
    quiet = normalize(GenerateRequest.model_validate({"lyrics": "la la", "tags": "pop"}), RequestLimits())
    assert quiet.notes == []


@pytest.mark.quick
def test_safe_escapes_line_breaks_and_caps():
    assert safe("a\nb\rc\td\x1b[31m\u2028e") == "a\\nb\\rc\\td\\x1b[31m\\u2028e"
    cut = safe("é" * 500, 10)
    assert cut == "é" * 10 + "…(+490 chars)"
    assert "\n" not in safe({"from": "x\ny"})


@pytest.mark.quick
def test_no_log_record_can_start_a_line_of_its_own():
    fmt = LineFormatter("%(levelname)s %(name)s: %(message)s")
    record = logging.LogRecord("t", logging.INFO, __file__, 1, "job %s: %s", ("j1", f"x\n{FORGED}"), None)
    assert fmt.format(record).count("\n") == 0
    long = logging.LogRecord("t", logging.INFO, __file__, 1, "%s", ("z" * 100_000,), None)
    assert len(fmt.format(long)) < MAX_MESSAGE_CHARS + 100
    try:
        raise ValueError(f"bad\n{FORGED}")
    except ValueError:
        import sys

        exc = logging.LogRecord("t", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    lines = fmt.format(exc).splitlines()
    assert lines[0] == "ERROR t: failed"
    assert all(line.startswith("    ") for line in lines[1:])  # the traceback, indented: never a record's start
    assert not any(line.startswith(FORGED[:10]) for line in lines)


def rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) api ")


@pytest.mark.process  # heavy load: 100 bodies of ~2.5 MB
def test_a_hundred_bodies_of_twenty_thousand_unknown_names(tmp_path):
    port = free_port()
    args = ["backend_api.py", "--port", str(port), "--state-dir", str(tmp_path / "state"), "--num-workers", "0"]
    api = ServerProcess([*args, "--max-body-bytes", "8000000", "--max-queue", "1000"], port, tmp_path / "api.log")
    try:
        api.wait_healthy(want=("ok",))
        headers = {"Content-Type": "application/json"}
        size_mb = len(json.dumps(probe_body(0))) / 2**20  # ~2.8 MB; every body's names are its own
        with httpx.Client(base_url=api.url, timeout=120, verify=TLS) as client:
            first = client.post("/generate", json=probe_body(-1))  # the dispatcher's first big body, unmeasured
            assert first.status_code == 200, first.text
            before = rss_mb(api.proc.pid)
            answers = []
            for i in range(100):
                r = client.post("/generate", content=json.dumps(probe_body(i)).encode(), headers=headers)
                assert r.status_code == 200, r.text
                answers.append(r)
            after = rss_mb(api.proc.pid)
            job = client.get(f"/job/{answers[-1].json()['job_id']}").text
        grown = after - before
        print(
            f"\n100 bodies of {size_mb:.1f} MB, 20,000 unknown names each: RSS {before:.1f} → {after:.1f} MB (+{grown:.1f})"
        )
        assert grown <= 20.0

        for r in answers:  # the client hears about them, bounded
            body = r.json()
            assert len(body["ignored"]) == MAX_NAMES
            assert all(len(n) <= MAX_NAME_CHARS for n in body["ignored"])
            assert f"{20_000 - MAX_NAMES} more unknown fields were ignored" in " ".join(body["notes"])
            assert r.headers["Warning"].startswith("299 ")
        assert "forged" not in job

        db = sqlite3.connect(tmp_path / "state" / "jobs.sqlite3")  # nothing of them stored with the jobs
        rows = db.execute("SELECT request FROM jobs").fetchall()
        db.close()
        assert len(rows) == 101
        assert not any("forged" in r[0] or "x0-" in r[0] for r in rows)
        biggest = max(len(r[0]) for r in rows)
        print(f"largest stored request: {biggest} bytes (was ~889 KB per job)")
        assert biggest < 2000

        lines = Path(api.log_path).read_text().splitlines()
        starts = [ln for ln in lines if not ln.startswith("    ")]
        assert all(RECORD.match(ln) for ln in starts), [ln for ln in starts if not RECORD.match(ln)][:3]
        assert not any(ln.startswith(FORGED[:19]) for ln in lines)
        ignored = [ln for ln in lines if "ignored 20000 unknown fields" in ln]
        assert len(ignored) == 101
        assert max(len(ln) for ln in ignored) < 1500
        assert "\\n2031-01-01" in ignored[0]  # the name is there, escaped
    finally:
        api.stop()
