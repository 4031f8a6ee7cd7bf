"""The newcomer's second hour: the messages a new user trips on, and the README's examples as written.

A dispatcher and tone workers in threads of this process (tests/support/in_thread.py, real sockets): a body
sent under curl's default Content-Type, a duration in seconds, a ``continue_from`` id that is not an
id, the CLI's sentences (a key, a server, a plural, the tiny model, a loudness it could not reach),
setup's pip noise, and every curl and CLI example of the README run in order as a person pastes
them. The page's items are in tests/browser/test_browser.py, the launcher's start and stop in
tests/process/test_first_hour.py and tests/process/test_launcher_stop.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf

from songserve.api.service.requests import RequestLimits, normalize
from songserve.errors import FieldError
from songserve.schemas import GenerateRequest
from tests.support.audio import spiky
from tests.support.http import TLS
from tests.support.servers import ROOT, Cluster

README = ROOT / "README.md"
JOB_PLACEHOLDER = "3f2a…"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("second_hour"), workers=2, delay=0.05, threads=True)
    yield c
    c.stop()


def cli(*args: str, cwd: Path = ROOT, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "songserve", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


# ---- what a request is answered ----------------------------------------------------------------------


@pytest.mark.parametrize("service", ["dispatcher", "worker"])
def test_a_json_body_sent_under_curls_default_type_is_415_naming_the_header(cluster, service):
    url = cluster.url if service == "dispatcher" else cluster.workers[0].url
    body = json.dumps({"tags": "pop", "lyrics": "la", "duration": 0.05})
    assert shutil.which("curl"), "curl is the client this answer is written for"
    out = subprocess.run(
        ["curl", "-s", "-w", "\n%{http_code}", url + "/generate", "-d", body],
        capture_output=True,
        text=True,
        timeout=30,
    )
    text, code = out.stdout.rsplit("\n", 1)
    assert code == "415", out.stdout
    error = json.loads(text)["error"]
    assert error.startswith("The body must be JSON sent with the header 'Content-Type: application/json'"), error
    assert "it came as 'application/x-www-form-urlencoded'" in error
    untyped = httpx.post(url + "/generate", content=body, verify=TLS)
    assert untyped.status_code == 415
    assert untyped.json()["error"].endswith("'Content-Type: application/json'; it came without one.")
    if service == "dispatcher":  # the same bytes as JSON are read
        r = httpx.post(url + "/generate", content=body, headers={"Content-Type": "application/json"}, verify=TLS)
        assert r.status_code == 200, r.text
        httpx.delete(f"{url}/job/{r.json()['job_id']}", verify=TLS)


LIMITS = RequestLimits(min_duration=0.05, max_duration=10.0)


@pytest.mark.parametrize(
    ("sent", "hint"), [(180, "for 180 seconds send 3"), (45, "for 45 seconds send 0.75"), (1000, "at most 10")]
)
@pytest.mark.parametrize("strict", [False, True])
def test_a_duration_that_only_makes_sense_in_seconds_is_refused_in_minutes(sent, hint, strict):
    with pytest.raises(FieldError) as err:
        normalize(GenerateRequest.model_validate({"duration": sent, "lyrics": "x"}), LIMITS, strict=strict)
    assert str(err.value).startswith(f"Field 'duration': is in minutes, and {sent} minutes is far over the 10-minute")
    assert hint in str(err.value)


def test_a_duration_read_as_the_reference_reads_it_is_said_in_notes(cluster):
    said = {}
    for sent in (0, 15):
        r = httpx.post(cluster.url + "/generate", json={"lyrics": "la", "duration": sent, "num_tracks": 1}, verify=TLS)
        assert r.status_code == 200, r.text
        httpx.delete(f"{cluster.url}/job/{r.json()['job_id']}", verify=TLS)
        said[sent] = r.json()
    assert said[0]["adjusted"] == {"duration": {"from": 0, "to": 1.0}}
    assert "A duration of 0 is not a length: the song is 1 minute, as the reference reads it." in said[0]["notes"]
    assert said[15]["adjusted"] == {"duration": {"from": 15, "to": 10.0}}
    assert "The duration is in minutes; 15 is past the maximum, so the song is 10 minutes." in said[15]["notes"]
    r = httpx.post(cluster.url + "/generate", json={"lyrics": "la", "duration": 180}, verify=TLS)
    assert r.status_code == 422
    assert r.json()["error"].startswith("Field 'duration': is in minutes")


def test_a_continue_from_id_that_is_not_an_id_is_answered_in_a_sentence(cluster):
    for field, sent in (("job_id", {"job_id": "my-song", "at_sec": 3}), ("upload_id", {"upload_id": "demo.mp3"})):
        r = httpx.post(cluster.url + "/generate", json={"continue_from": sent}, verify=TLS)
        assert r.status_code == 422
        error = r.json()["error"]
        assert "pattern" not in error, error
        assert "^[" not in error
        what = "a job" if field == "job_id" else "an upload"
        assert error.startswith(
            f"Field 'continue_from.{field}': {sent[field]!r} is not {what} id: ids are the 8 "
            "to 64 lowercase hex digits that "
        ), error
    schema = httpx.get(cluster.url + "/openapi.json", verify=TLS).json()["components"]["schemas"]["ContinueFrom"]
    assert "[a-f0-9]{8,64}" in json.dumps(schema["properties"]["job_id"])  # the pattern still told to clients
    unknown = httpx.post(
        cluster.url + "/generate", json={"continue_from": {"job_id": "0" * 16, "at_sec": 3}}, verify=TLS
    )
    assert "is not known here" in unknown.json()["error"]  # a well-formed one, as before


# ---- the CLI -------------------------------------------------------------------------------------------


def test_the_cli_names_the_option_and_variable_for_a_key_and_for_a_server(tmp_path):
    keyed = Cluster(tmp_path, workers=1, delay=0.05, threads=True, api_args=("--api-key", "k-right"))
    try:
        env = {k: v for k, v in os.environ.items() if k not in ("SONGSERVE_API_KEY", "SONGSERVE_URL")}
        none = cli("--server", keyed.url, "status", env=env)
        assert none.returncode == 1
        assert none.stderr.strip().endswith("pass it with --api-key KEY or set SONGSERVE_API_KEY."), none.stderr
        wrong = cli("--server", keyed.url, "--api-key", "k-wrong", "status", env=env)
        assert "did not accept the API key given" in wrong.stderr, wrong.stderr
        assert "--api-key KEY or set SONGSERVE_API_KEY" in wrong.stderr
        assert cli("--server", keyed.url, "status", env={**env, "SONGSERVE_API_KEY": "k-right"}).returncode == 0
    finally:
        keyed.stop()
    gone = cli("--server", "http://127.0.0.1:9", "status")
    assert gone.returncode == 1
    assert "cannot reach http://127.0.0.1:9" in gone.stderr
    assert "--server URL or SONGSERVE_URL" in gone.stderr


def test_the_cli_says_one_track_and_says_once_that_the_tiny_model_is_in_use(tmp_path):
    flags = ("--pipeline", "test", "--test-delay-s", "0.05", "--test-untrained", "true")
    tiny = Cluster(tmp_path, workers=1, threads=True, worker_args=flags)
    try:
        out = cli(
            "--server",
            tiny.url,
            "generate",
            "--lyrics",
            "la",
            "--duration",
            "0.05",
            "--tracks",
            "1",
            "--formats",
            "mp3",
            "--out",
            str(tmp_path / "out"),
        )
        assert out.returncode == 0, out.stderr
        assert re.search(r"^job [0-9a-f]+: (accepted|queued) \(1 track\)$", out.stdout, re.M), out.stdout
        assert out.stdout.count("note: Tiny test model: the audio is noise of the right length.") == 1, out.stdout
    finally:
        tiny.stop()


def test_a_loudness_a_render_could_not_reach_is_said_beside_the_saved_file(cluster, tmp_path):
    from songserve.cli.commands import save

    job = cluster.submit(num_tracks=1)
    done = cluster.wait_job(job["job_id"])
    assert done["status"] == "completed"
    spiky(cluster.tmp / "state" / "results" / job["job_id"] / "track_0.wav")
    with httpx.Client(base_url=cluster.url, timeout=60, verify=TLS) as client:
        line = save(client, job["job_id"], done["tracks"][0], "flac", -14.0, tmp_path)
        plain = save(client, job["job_id"], done["tracks"][0], "flac", None, tmp_path)
    assert re.fullmatch(
        r"saved \S+_-14LUFS\.flac at -\d+\.\d\d LUFS, not -14: any louder would clip "
        r"\(the take's peaks stop the gain at -1 dBFS\)",
        line,
    ), line
    assert plain == f"saved {tmp_path / (job['job_id'] + '_track0.flac')}"


# ---- setup's output ---------------------------------------------------------------------------------


def test_pips_missing_index_pages_go_to_the_log_not_the_console(tmp_path):
    warn = "WARNING: Location '/nowhere/simple/x/' is ignored: it is neither a file nor a directory."
    pip = ["sh", "-c", f'echo "{warn}"; echo "{warn}"; echo "ERROR: a real one" >&2; exit 3']
    log = tmp_path / "setup.log"
    env = {k: v for k, v in os.environ.items() if k != "SETUP_VERBOSE"}
    quiet = subprocess.run(
        ["bash", str(ROOT / "scripts" / "pip-quiet"), str(log), *pip], capture_output=True, text=True, env=env
    )
    assert quiet.returncode == 3  # pip's own status
    assert quiet.stdout == ""
    assert quiet.stderr == "ERROR: a real one\n"
    assert "pip skipped 2 index pages" in log.read_text()
    loud = subprocess.run(
        ["bash", str(ROOT / "scripts" / "pip-quiet"), str(log), *pip],
        capture_output=True,
        text=True,
        env={**env, "SETUP_VERBOSE": "1"},
    )
    assert "pip skipped 2 index pages" in loud.stdout


# ---- the README's examples, as written, in order --------------------------------------------------


def shell_commands(block: str) -> list[str]:
    """A bash block's commands: lines joined while a quote is open, comments (outside quotes) cut."""
    commands: list[str] = []
    current, quote = "", ""
    for line in block.splitlines():
        kept = []
        for i, ch in enumerate(line):
            if quote:
                quote = "" if ch == quote else quote
            elif ch in "'\"":
                quote = ch
            elif ch == "#" and (i == 0 or line[i - 1].isspace()):
                break
            kept.append(ch)
        current = f"{current}\n{''.join(kept)}" if current else "".join(kept).strip()
        if not quote and current:
            commands.append(current.strip())
            current = ""
    return commands


def readme_commands() -> list[str]:
    """Every curl and songserve command of the README's bash blocks, in order."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
    return [c for block in blocks for c in shell_commands(block) if c.startswith(("curl ", "songserve "))]


def test_the_readmes_curl_and_cli_examples_run_as_written_in_order(cluster, tmp_path):
    commands = readme_commands()
    assert len(commands) >= 10, commands
    (tmp_path / "song.txt").write_text("[verse]\nhello world\nsecond line\n")
    (tmp_path / "rest.txt").write_text("[chorus]\nand the rest\n")
    t = np.arange(31 * 22050) / 22050
    sf.write(tmp_path / "demo.mp3", np.stack([0.3 * np.sin(2 * np.pi * 220 * t)] * 2, 1), 22050, format="MP3")
    host = cluster.url.removeprefix("http://")
    env = {**os.environ, "SONGSERVE_URL": cluster.url}
    env.pop("SONGSERVE_API_KEY", None)
    job_id = None
    ran = []
    for command in commands:
        cmd = command.replace("localhost:8889", host).replace("| mpv -", "-o stream.mp3")
        if JOB_PLACEHOLDER in cmd:
            assert job_id, f"{command!r} names a job before the README made one"
            cmd = cmd.replace(JOB_PLACEHOLDER, job_id)
        if cmd.startswith("songserve "):
            cmd = f"{sys.executable} -m {cmd}"
        else:
            cmd = cmd.replace("curl ", "curl -w '\\n%{http_code}' ", 1)
        out = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, (command, out.stdout, out.stderr)
        if not cmd.startswith(sys.executable):
            code = int(out.stdout.rsplit("\n", 1)[-1])
            assert code < 400, (command, out.stdout)
            if "/generate" in cmd and job_id is None:  # the submit: a person waits for it before the rest
                job_id = json.loads(out.stdout.rsplit("\n", 1)[0])["job_id"]
                assert cluster.wait_job(job_id, timeout=240)["status"] == "completed"
        ran.append(command.split()[0] + " " + command.split()[-1][:40])
    assert (tmp_path / "take0.mp3").stat().st_size > 0
    assert (tmp_path / "take0.flac").stat().st_size > 0
    assert (tmp_path / "stream.mp3").stat().st_size > 0
    assert len(list((tmp_path / "songs").glob("*_track1.mp3"))) >= 1
