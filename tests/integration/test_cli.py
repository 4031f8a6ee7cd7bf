"""The CLI client against a running dispatcher (real processes)."""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys

import httpx
import pyloudnorm
import pytest
import soundfile as sf

from songserve.audio import codes
from songserve.cli.commands import _submit
from tests.support.http import TLS
from tests.support.servers import ROOT, Cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("cli"), workers=1, delay=0.3, threads=True)
    yield c
    c.stop()


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "songserve", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_generate_downloads_every_track(cluster, tmp_path):
    lyrics = tmp_path / "song.txt"
    lyrics.write_text("[verse]\nhello\nworld\n", encoding="utf-8")
    out = cli(
        "--server",
        cluster.url,
        "generate",
        "--lyrics-file",
        str(lyrics),
        "--tags",
        "pop, piano",
        "--duration",
        "0.1",
        "--tracks",
        "2",
        "--out",
        str(tmp_path / "out"),
    )
    assert out.returncode == 0, out.stderr
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert len(files) == 4
    assert sum(f.endswith(".mp3") for f in files) == 2
    assert "track 1: [########################] 100% Done" in out.stdout
    assert out.stdout.strip().endswith("completed")


def test_server_error_sentence_and_nonzero_exit(cluster, tmp_path):
    out = cli("--server", cluster.url, "generate", "--lyrics", "x", "--tracks", "9", "--out", str(tmp_path))
    assert out.returncode == 1
    assert out.stderr.strip() == "error: Field 'num_tracks': must be at most 4."
    out = cli("--server", "http://127.0.0.1:9", "status")
    assert out.returncode == 1
    assert "cannot reach" in out.stderr


def test_status_prints_the_worker_table(cluster):
    out = cli("--server", cluster.url, "status")
    assert out.returncode == 0
    lines = out.stdout.splitlines()
    assert lines[0].startswith("1/1 workers idle")
    assert "idle" in lines[2]
    assert cluster.workers[0].url in lines[2]


def test_adapters_are_listed_and_a_take_naming_one_the_workers_lack_is_refused_in_the_servers_words(cluster, tmp_path):
    out = cli("--server", cluster.url, "adapters")
    assert out.returncode == 0
    assert out.stdout.strip() == "no adapters: no worker has one in its ADAPTERS_DIR"
    out = cli(
        "--server", cluster.url, "generate", "--lyrics", "x", "--adapters", "none,studio-a@0.5", "--out", str(tmp_path)
    )
    assert out.returncode == 1
    assert out.stderr.startswith("error: Field 'takes.1.adapter': no worker here can load adapter 'studio-a'")
    out = cli("--server", cluster.url, "generate", "--lyrics", "x", "--adapter", "a@loud", "--out", str(tmp_path))
    assert out.returncode == 1
    assert "expected NAME or NAME@SCALE" in out.stderr


def test_adapter_upload_and_delete_say_the_servers_refusal_and_a_folder_without_the_files_is_refused_here(
    cluster, tmp_path
):
    out = cli("--server", cluster.url, "adapters", "upload", str(tmp_path))
    assert out.returncode == 1
    assert "is not an adapter folder: no " in out.stderr
    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "adapter_model.safetensors").write_bytes(b"\0" * 16)
    out = cli("--server", cluster.url, "adapters", "upload", str(tmp_path), "--name", "mine")
    assert out.returncode == 1
    assert out.stderr.startswith("error: No worker here serves adapters"), out.stderr  # tone workers
    out = cli("--server", cluster.url, "adapters", "delete", "mine")
    assert out.returncode == 1
    assert out.stderr.startswith("error: No uploaded adapter 'mine'"), out.stderr


class LosesFirstAnswer(httpx.HTTPTransport):
    """Real HTTP, except that the first answer is lost on the way back (the server did the work)."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[httpx.Request] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(request)
        response = super().handle_request(request)
        if len(self.sent) == 1:
            response.close()
            raise httpx.ReadError("connection reset by peer", request=request)
        return response


def test_a_submission_whose_answer_is_lost_is_sent_again_and_makes_one_job(cluster):
    transport = LosesFirstAnswer()
    body = {"lyrics": "once", "duration": 0.05, "num_tracks": 1}
    with httpx.Client(base_url=cluster.url, transport=transport, timeout=30) as client:
        job_id = _submit(client, body).json()["job_id"]
    assert len(transport.sent) == 2
    keys = {r.headers["Idempotency-Key"] for r in transport.sent}
    assert len(keys) == 1  # the same key both times
    first = httpx.post(cluster.url + "/generate", json=body, headers={"Idempotency-Key": keys.pop()}, verify=TLS).json()
    assert first["job_id"] == job_id  # the job the lost answer made: the retry did not make a second one


def test_continue_retakes_a_finished_take_and_downloads_rendered_formats(cluster, tmp_path):
    original = cluster.submit(tags="pop", lyrics="[verse]\nfirst take", duration=0.1, num_tracks=1)
    assert cluster.wait_job(original["job_id"])["status"] == "completed"
    spec = f"{original['job_id']}:0@2.5"
    out = cli(
        "--server",
        cluster.url,
        "generate",
        "--continue",
        spec,
        "--tracks",
        "1",
        "--formats",
        "codes,flac",
        "--loudness",
        "-18",
        "--out",
        str(tmp_path),
    )
    assert out.returncode == 0, out.stderr
    grid = codes.read(next(tmp_path.glob("*_track0.codes")))
    assert grid.header["continued"]["frames"] == int(2.5 * grid.header["frame_rate"])
    assert grid.frames == int(6.0 * grid.header["frame_rate"])  # the original's 0.1 minutes, not the CLI's default
    x, rate = sf.read(tmp_path / f"{out.stdout.split()[1].rstrip(':')}_track0_-18LUFS.flac")  # named by its loudness
    assert abs(pyloudnorm.Meter(rate).integrated_loudness(x) + 18) <= 0.5
    bad = cli("--server", cluster.url, "generate", "--continue", "nope@3", "--out", str(tmp_path))
    assert bad.returncode == 1
    assert "expected JOB:TRACK@SEC" in bad.stderr


def test_continue_with_an_end_repaints_that_part_and_says_why_a_bad_one_is_refused(cluster, tmp_path):
    original = cluster.submit(tags="pop", lyrics="[verse]\nfirst take", duration=0.1, num_tracks=1)
    assert cluster.wait_job(original["job_id"])["status"] == "completed"
    spec = f"{original['job_id']}:0@2-4"
    out = cli("--server", cluster.url, "generate", "--continue", spec, "--formats", "codes", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    grid = codes.read(next(tmp_path.glob("*_track0.codes")))
    fps = grid.header["frame_rate"]
    assert (grid.header["repainted"]["start_frame"], grid.header["repainted"]["end_frame"]) == (
        int(2 * fps),
        round(4 * fps),
    )
    assert grid.frames == int(6.0 * fps)
    opened = tmp_path / "opened"
    spec = f"{original['job_id']}:0@-1.5"
    out = cli("--server", cluster.url, "generate", "--continue", spec, "--formats", "codes", "--out", str(opened))
    assert out.returncode == 0, out.stderr
    grid = codes.read(next(opened.glob("*_track0.codes")))
    assert grid.header["repainted"]["opening"] == round(1.5 * fps)
    assert grid.frames == int(6.0 * fps) + round(1.5 * fps)
    bad = cli("--server", cluster.url, "generate", "--continue", f"{original['job_id']}:0@2-9", "--out", str(tmp_path))
    assert bad.returncode == 1
    assert "continue_from.end_sec" in bad.stderr
    assert "past the end of the song" in bad.stderr
    parts = tmp_path / "parts"
    spec = f"{original['job_id']}:0@1-2,3.5-4.5"
    out = cli("--server", cluster.url, "generate", "--continue", spec, "--formats", "codes", "--out", str(parts))
    assert out.returncode == 0, out.stderr
    grid = codes.read(next(parts.glob("*_track0.codes")))
    assert [(p["start_frame"], p["end_frame"]) for p in grid.header["repainted"]["parts"]] == [
        (int(1 * fps), round(2 * fps)),
        (int(3.5 * fps), round(4.5 * fps)),
    ]
    bad = cli(
        "--server", cluster.url, "generate", "--continue", f"{original['job_id']}:0@1-2,2.5-4", "--out", str(parts)
    )
    assert bad.returncode == 1
    assert "continue_from.parts.1" in bad.stderr


def test_listen_writes_the_first_take_as_it_comes_to_a_file_or_stdout(cluster, tmp_path):
    dest = tmp_path / "live.wav"
    base = ("--server", cluster.url, "generate", "--lyrics", "la", "--duration", "0.1", "--tracks", "1")
    out = cli(*base, "--seed", "4", "--listen", str(dest), "--formats", "wav", "--out", str(tmp_path / "out"))
    assert out.returncode == 0, out.stderr
    assert f"written to {dest} as they came" in out.stdout
    final, rate = sf.read(next((tmp_path / "out").glob("*.wav")), dtype="int16")
    heard = dest.read_bytes()
    assert heard[:4] == b"RIFF"
    assert heard[44:] == final.tobytes()  # the tone's live audio is its final audio, every sample
    piped = subprocess.run(
        [sys.executable, "-m", "songserve", *base, "--listen", "-", "--formats", "mp3", "--out", str(tmp_path / "o2")],
        cwd=ROOT,
        capture_output=True,
        timeout=120,
    )
    assert piped.returncode == 0, piped.stderr
    assert b"written to standard output" in piped.stderr  # progress and messages on stderr
    audio, rate = sf.read(io.BytesIO(piped.stdout))  # stdout: the MP3 stream alone
    assert abs(len(audio) / rate - 6.0) < 0.2
    unwritable = cli(*base, "--listen", str(tmp_path / "no" / "such" / "dir.mp3"))
    assert unwritable.returncode == 1
    assert "No such file or directory" in unwritable.stderr


def test_continue_audio_uploads_a_file_and_continues_it(cluster, tmp_path):
    import numpy as np

    t = np.arange(3 * 44100) / 44100
    song = tmp_path / "my demo@home.flac"  # an '@' in the name is part of the name when the file exists
    sf.write(song, np.stack([0.3 * np.sin(2 * np.pi * 220 * t)] * 2, 1), 22050 * 2, format="FLAC")
    out = cli(
        "--server",
        cluster.url,
        "generate",
        "--continue-audio",
        f"{song}@2",
        "--tags",
        "rock",
        "--lyrics",
        "on",
        "--duration",
        "0.1",
        "--tracks",
        "1",
        "--formats",
        "codes",
        "--out",
        str(tmp_path / "out"),
    )
    assert out.returncode == 0, out.stderr
    assert "upload " in out.stdout
    assert "my demo@home.flac, 3.0 s" in out.stdout
    grid = codes.read(next((tmp_path / "out").glob("*_track0.codes")))
    assert grid.header["continued"]["frames"] == int(2 * grid.header["frame_rate"])
    assert grid.header["continued"]["origin"].startswith("upload/")
    out = cli(
        "--server", cluster.url, "generate", "--continue-audio", str(song), "--tracks", "1", "--out", str(tmp_path)
    )
    assert out.returncode == 0, out.stderr  # to its end, a song of a minute by default
    text = tmp_path / "lyrics.txt"
    text.write_text("not audio")
    bad = cli("--server", cluster.url, "generate", "--continue-audio", str(text), "--out", str(tmp_path))
    assert bad.returncode == 1
    assert bad.stderr.strip() == (
        "error: Field 'file': the file is not audio that can be read (WAV, FLAC, OGG, MP3 and other libsndfile formats)."
    )


def test_every_option_has_help():
    from songserve.cli.commands import parser

    ap = parser()
    subs = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    for p in (ap, *subs.choices.values()):
        for action in p._actions:
            assert action.help, f"{p.prog} {action.option_strings or action.dest} has no help text"
    assert "SONGSERVE_URL" in ap.format_help()
    assert "SONGSERVE_API_KEY" in ap.format_help()


def test_the_installed_command_works_from_any_folder(cluster, tmp_path):
    """``scripts/setup`` installs the project into .venv: ``songserve`` runs outside the repository."""
    command = ROOT / ".venv" / "bin" / "songserve"
    away = tmp_path / "elsewhere"
    away.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SONGSERVE_API_KEY")}
    env["SONGSERVE_URL"] = cluster.url  # the server from the environment, as a user sets it once

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(command), *args], cwd=away, env=env, capture_output=True, text=True, timeout=120)

    helped = run("--help")
    assert helped.returncode == 0, helped.stderr
    assert helped.stdout.startswith("usage: songserve")
    assert "generate" in run("generate", "--help").stdout
    made = run("generate", "--lyrics", "la la", "--tags", "pop", "--duration", "0.05", "--tracks", "1")
    assert made.returncode == 0, made.stderr
    assert made.stdout.strip().endswith("completed")
    assert len(list((away / "songs").glob("*_track0.mp3"))) == 1  # --out is relative to where it ran
    module = subprocess.run(
        [sys.executable, "-m", "songserve", "--help"], cwd=away, env=env, capture_output=True, text=True, timeout=60
    )
    assert module.returncode == 0, module.stderr
