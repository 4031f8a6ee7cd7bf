"""The command-line client: ``songserve generate …`` and ``songserve status``.

``scripts/setup`` installs the project into ``.venv``, so with the environment active ``songserve``
works from any folder (``python -m songserve`` is the same program).

    songserve generate --lyrics-file song.txt --tags "pop, piano" --duration 0.1 --tracks 2 --out songs/
    songserve generate --continue 3f2a9c01d4e5b677:0@80 --tracks 2 --formats mp3,flac --loudness -14
    songserve generate --continue 3f2a9c01d4e5b677:0@80-100 --tracks 3 --lyrics-file bridge.txt
    songserve generate --continue-audio demo.mp3@42.5 --tags "rock" --lyrics-file rest.txt --duration 3
    songserve generate --lyrics-file song.txt --tags "pop" --tracks 3 --adapters studio-a,studio-b@0.5,none
    songserve status
    songserve adapters
    songserve adapters upload my-lora/ --name studio-voice   # a key allowed to upload adapters
    songserve adapters delete studio-voice
    songserve mcp                    # an MCP server on stdin/stdout for desktop clients (docs/mcp.md)

Without ``--duration`` the song has the server's default length (``POST /generate``: 3 minutes).

``--continue JOB:TRACK@SEC`` retakes a finished take from SEC seconds on: what comes before is kept,
and whatever is not given on the command line (style, lyrics, duration) stays the original's.
``--continue JOB:TRACK@SEC-END`` repaints the part from SEC to END seconds: the take is kept before SEC
and after a join near END, and the part between is written again (with the lyrics given, if any);
``--continue JOB:TRACK@A-B,C-D`` repaints several parts in one request (each rejoins the original at its own join);
``--continue JOB:TRACK@-SEC`` extends the take at its start with a new opening of SEC seconds.
``--continue-audio FILE[@SEC]`` uploads your own audio (``POST /uploads``: WAV, FLAC, OGG, MP3, any
rate) and continues it from SEC seconds on (its end without ``@SEC``) with the style and lyrics given;
without ``--duration`` the song is the upload plus 30 s (at least a minute).
``--adapter NAME[@SCALE]`` makes every take with that LoRA adapter (``songserve adapters`` lists those the
workers can load); ``--adapters A,B@0.5,none`` gives each take its own (``none``: the base model).
``songserve adapters upload DIR`` sends DIR's ``adapter_config.json`` and ``adapter_model.safetensors``
(``POST /adapters``, named ``--name`` or the folder's name); every worker checks them, and only the
key that uploaded them sees them. ``songserve adapters delete NAME`` removes one of the key's uploads.
``--formats`` may name ``flac`` and ``opus`` too (rendered by the dispatcher, at ``--loudness`` LUFS).
``--listen FILE`` writes the first take to FILE as it is made (``.wav``: 16-bit PCM, else MP3), from
its first seconds to its end; ``--listen -`` writes it to standard output (progress goes to
standard error), e.g. ``songserve generate --listen - … | mpv -``.

Talks to the dispatcher over HTTP (``--server``, default ``$SONGSERVE_URL`` or http://127.0.0.1:8889), with
``--api-key`` (default ``$SONGSERVE_API_KEY``) as ``Authorization: Bearer``.
Exits non-zero with the server's error sentence when something fails.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, TextIO

import httpx

from songserve.http.keepalive import CLIENT_KEEPALIVE_SEC

TERMINAL = {"completed", "partial", "failed", "cancelled"}
CONTINUE = re.compile(r"^([0-9a-f]{8,64}):(\d{1,4})@(-?\d+(?:\.\d*)?)(?:-(\d+(?:\.\d*)?))?$")
PARTS = re.compile(r"^([0-9a-f]{8,64}):(\d{1,4})@(\d+(?:\.\d*)?-\d+(?:\.\d*)?(?:,\d+(?:\.\d*)?-\d+(?:\.\d*)?)+)$")
AUDIO_AT = re.compile(r"^(.+)@(\d+(?:\.\d*)?)$")
STORED = ("mp3", "wav", "codes")  # the files a track has; any other format is rendered from its WAV


class ClientError(Exception):
    pass


def _check(r: httpx.Response) -> dict[str, Any]:
    try:
        body: dict[str, Any] = r.json()
    except ValueError:
        body = {}
    if r.status_code == 401:  # what to do, not only what the server found
        said = body.get("error") or "HTTP 401"
        if "Authorization" in r.request.headers:
            raise ClientError(
                f"The server did not accept the API key given ({said}); pass the right one with "
                "--api-key KEY or set SONGSERVE_API_KEY."
            )
        raise ClientError(f"The server needs an API key ({said}); pass it with --api-key KEY or set SONGSERVE_API_KEY.")
    if r.status_code >= 400:
        raise ClientError(body.get("error") or f"The server answered HTTP {r.status_code}.")
    return body


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def say_untrained(client: httpx.Client, out: TextIO) -> None:
    """Once per command: the server's notice when its workers run an untrained set (the tiny test model)."""
    try:
        notice = _check(client.get("/config")).get("notice")
    except (ClientError, httpx.HTTPError):  # the submit that follows says what is wrong
        return
    if notice:
        print(f"note: {notice}", file=out)


def _bar(progress: int, width: int = 24) -> str:
    filled = width * progress // 100
    return "[" + "#" * filled + "-" * (width - filled) + f"] {progress:3d}%"


def _submit(client: httpx.Client, body: dict[str, Any]) -> httpx.Response:
    """POST /generate under an Idempotency-Key, sent again once if the connection drops on the way:
    the key makes the second try return the job the first one may have made, never a second job."""
    headers = {"Idempotency-Key": uuid.uuid4().hex}
    try:
        return client.post("/generate", json=body, headers=headers)
    except httpx.TransportError:
        return client.post("/generate", json=body, headers=headers)


def continue_from(text: str) -> dict[str, Any]:
    """``JOB:TRACK@SEC`` (a retake), ``JOB:TRACK@SEC-END`` (a repaint), ``JOB:TRACK@A-B,C-D`` (a repaint
    of several parts) or ``JOB:TRACK@-SEC`` (an opening of SEC seconds) → the request's ``continue_from``."""
    several = PARTS.match(text)
    if several is not None:
        parts = [part.split("-") for part in several.group(3).split(",")]
        return {
            "job_id": several.group(1),
            "track_index": int(several.group(2)),
            "parts": [{"at_sec": float(a), "end_sec": float(b)} for a, b in parts],
        }
    m = CONTINUE.match(text)
    if m is None:
        raise ClientError(
            f"--continue {text!r}: expected JOB:TRACK@SEC, JOB:TRACK@SEC-END or JOB:TRACK@A-B,C-D, "
            "e.g. 3f2a9c01d4e5b677:0@80.5"
        )
    cf: dict[str, Any] = {"job_id": m.group(1), "track_index": int(m.group(2))}
    at = float(m.group(3))
    if at < 0 and m.group(4) is None:
        return cf | {"before_sec": -at}  # JOB:TRACK@-SEC: a new opening of SEC seconds
    cf["at_sec"] = at
    if m.group(4) is not None:
        cf["end_sec"] = float(m.group(4))
    return cf


def audio_at(text: str) -> tuple[Path, float | None]:
    """``FILE[@SEC]`` → the file and the second to continue it from (None: its end)."""
    m = AUDIO_AT.match(text)
    if m is not None and not Path(text).is_file():
        return Path(m.group(1)), float(m.group(2))
    return Path(text), None


def adapter_choice(text: str, option: str) -> tuple[str | None, float]:
    """``NAME``, ``NAME@SCALE`` or ``none`` (the base model) → (name, scale)."""
    if text in ("none", "-", ""):
        return None, 1.0
    name, _, scale = text.partition("@")
    try:
        return name, float(scale) if scale else 1.0
    except ValueError:
        raise ClientError(f"{option} {text!r}: expected NAME or NAME@SCALE, e.g. studio-a@0.8") from None


ADAPTER_FILES = {"config": "adapter_config.json", "weights": "adapter_model.safetensors"}  # form field → file


def adapters(args: argparse.Namespace, client: httpx.Client, out: TextIO = sys.stdout) -> int:
    """The LoRA adapters the workers can load (``GET /adapters``), and where each is resident; or, with
    ``upload`` and ``delete``, one of the key's own."""
    action = getattr(args, "action", None)
    if action == "upload":
        return upload_adapter(client, Path(args.dir), args.name, out)
    if action == "delete":
        gone = _check(client.delete(f"/adapters/{args.name}"))
        print(f"adapter {gone['name']}: deleted (the workers drop it)", file=out)
        return 0
    listed = _check(client.get("/adapters"))["adapters"]
    if not listed:
        print("no adapters: no worker has one in its ADAPTERS_DIR", file=out)
    for a in listed:
        rank = f"rank {a['rank']}" if a.get("rank") else "rank ?"
        where = ", ".join(str(w) for w in a["resident_on"]) or "none"
        mine = f", uploaded by {a.get('owner') or 'no key'}" if a.get("uploaded") else ""
        print(f"{a['name']}: {rank}, workers {a['workers']}, resident on {where}{mine}", file=out)
    return 0


def upload_adapter(client: httpx.Client, folder: Path, name: str | None, out: TextIO = sys.stdout) -> int:
    """``POST /adapters`` of a PEFT adapter folder, named ``name`` (default: the folder's name)."""
    paths = {field: folder / filename for field, filename in ADAPTER_FILES.items()}
    missing = [str(p) for p in paths.values() if not p.is_file()]
    if missing:
        raise ClientError(f"{folder} is not an adapter folder: no {', '.join(missing)}")
    with paths["config"].open("rb") as config, paths["weights"].open("rb") as weights:
        files = {
            "config": (ADAPTER_FILES["config"], config, "application/json"),
            "weights": (ADAPTER_FILES["weights"], weights, "application/octet-stream"),
        }
        view = _check(client.post("/adapters", data={"name": name or folder.name}, files=files, timeout=300))
    print(
        f"adapter {view['name']}: uploaded (rank {view['rank']}, {view['bytes']} bytes, sha256 {view['sha256'][:12]}…), "
        f"on workers {view['workers']}",
        file=out,
    )
    return 0


def upload_audio(client: httpx.Client, path: Path, out: TextIO = sys.stdout) -> dict[str, Any]:
    """``POST /uploads`` of one file; its view (status queued: the server encodes it while the job waits)."""
    with open(path, "rb") as f:
        up = _check(client.post("/uploads", files={"file": (path.name, f, "application/octet-stream")}, timeout=300))
    print(f"upload {up['upload_id']}: {path.name}, {up['duration_sec']:.1f} s, {up['status']}", file=out)
    return up


def request_body(args: argparse.Namespace, upload: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``POST /generate`` body; a retake sends only what was given, the rest is the original's."""
    retake = args.cont is not None
    body: dict[str, Any] = {"num_tracks": args.tracks}
    if upload is not None:  # a continuation of one's own audio: a new song that starts with it
        _, at = audio_at(args.cont_audio)
        body["continue_from"] = {"upload_id": upload["upload_id"], **({"at_sec": at} if at is not None else {})}
        if args.duration is None:
            args.duration = round(max(1.0, (upload["duration_sec"] + 30) / 60), 2)
    if retake:
        body["continue_from"] = continue_from(args.cont)
    if args.lyrics_file or args.lyrics is not None or not retake:
        body["lyrics"] = Path(args.lyrics_file).read_text(encoding="utf-8") if args.lyrics_file else (args.lyrics or "")
    if args.instrumental or not retake:
        body["mode"] = "instrumental" if args.instrumental else "vocal"
    if args.tags is not None or not retake:
        body["tags"] = args.tags or ""
    if args.duration is not None:  # else the server's default (a retake: the original's length)
        body["duration"] = args.duration
    if args.prompt:
        body.update(prompt_mode="natural", prompt=args.prompt)
    if args.seed is not None:
        body["seed"] = args.seed
    if args.adapter:
        name, scale = adapter_choice(args.adapter, "--adapter")
        body |= {"adapter": name, "adapter_scale": scale}
    if args.adapters:
        choices = [adapter_choice(c.strip(), "--adapters") for c in args.adapters.split(",")]
        body["takes"] = [{"adapter": n, "adapter_scale": s} for n, s in choices]
        body["num_tracks"] = len(choices)
    if args.listen:
        body["preview"] = True  # live audio from the first seconds, not only once the listener connects
    return body


class Listener:
    """Writes take 0's stream (``GET …/stream``) to a file or stdout as it arrives, in a thread."""

    def __init__(self, dest: str) -> None:
        self.dest = dest
        self.fmt = "wav" if dest.lower().endswith(".wav") else "mp3"
        self.bytes = 0
        self.error = ""
        # Opened before the job is submitted: a path that cannot be written is the command's error.
        self.sink = sys.stdout.buffer if dest == "-" else open(dest, "wb")
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self, client: httpx.Client, job_id: str) -> None:
        self.client, self.job_id = client, job_id
        self.thread.start()

    def _run(self) -> None:
        url = f"/job/{self.job_id}/track/0/stream"
        sink = self.sink
        try:
            with self.client.stream("GET", url, params={"format": self.fmt}, timeout=httpx.Timeout(30, read=None)) as r:
                if r.status_code >= 400:
                    r.read()
                    _check(r)
                for chunk in r.iter_raw():
                    sink.write(chunk)
                    sink.flush()  # a player reading the file (or the pipe) hears it now
                    self.bytes += len(chunk)
        except (ClientError, httpx.HTTPError) as exc:  # a cut stream: the track failed or was cancelled
            self.error = str(exc) or type(exc).__name__
        finally:
            if sink is not sys.stdout.buffer:
                sink.close()

    def report(self, out: TextIO) -> None:
        self.thread.join(timeout=60)
        where = "standard output" if self.dest == "-" else self.dest
        ended = f", then it was cut ({self.error})" if self.error else ""
        print(f"listened: {self.bytes} bytes of track 0 written to {where} as they came{ended}", file=out)


def _file_url(job_id: str, track: dict[str, Any], kind: str, loudness: float | None) -> tuple[str, dict[str, Any]]:
    if kind in STORED:
        return track["files"][kind], {}
    params: dict[str, Any] = {"format": kind}
    if loudness is not None:
        params["loudness"] = loudness
    return f"/job/{job_id}/track/{track['index']}/render", params


def save(
    client: httpx.Client, job_id: str, track: dict[str, Any], kind: str, loudness: float | None, out_dir: Path
) -> str:
    """Download one file of a finished track into ``out_dir``; the line that says what was saved, and a
    loudness that could not be reached without clipping (the render's ``X-Render-Limited``)."""
    at = f"_{round(loudness, 1):g}LUFS" if kind not in STORED and loudness is not None else ""
    dest = out_dir / f"{job_id}_track{track['index']}{at}.{kind}"  # as the server names the render
    url, params = _file_url(job_id, track, kind, loudness)
    with client.stream("GET", url, params=params, timeout=300) as r:
        if r.status_code >= 400:
            r.read()
            _check(r)
        with open(dest, "wb") as f:
            for chunk in r.iter_bytes():
                f.write(chunk)
    if loudness is not None and r.headers.get("X-Render-Limited") == "true":
        return (
            f"saved {dest} at {r.headers.get('X-Render-Loudness')} LUFS, not {loudness:g}: any louder would "
            "clip (the take's peaks stop the gain at -1 dBFS)"
        )
    return f"saved {dest}"


def generate(args: argparse.Namespace, client: httpx.Client, out: TextIO = sys.stdout) -> int:
    if args.cont is not None and args.cont_audio is not None:
        raise ClientError("--continue and --continue-audio: give one of them")
    listener = Listener(args.listen) if args.listen else None  # before anything is stored: a bad path stops here
    upload = upload_audio(client, audio_at(args.cont_audio)[0], out) if args.cont_audio is not None else None
    body = request_body(args, upload)
    say_untrained(client, out)
    accepted = _check(_submit(client, body))
    job_id = accepted["job_id"]
    print(f"job {job_id}: {accepted['status']} ({plural(accepted['num_tracks'], 'track')})", file=out)
    for note in accepted.get("notes") or []:  # what the server read differently, in its own words
        print(f"note: {note}", file=out)
    if listener is not None:
        listener.start(client, job_id)
    tty = out.isatty()
    last: list[str] = []
    while True:
        job = _check(client.get(f"/job/{job_id}"))
        lines = [f"  track {t['index']}: {_bar(t['progress'])} {t['phase_display']}" for t in job["tracks"]]
        if lines != last:
            if tty and last:
                out.write(f"\x1b[{len(last)}A")
            for line in lines:
                out.write(("\x1b[2K" if tty else "") + line + "\n")
            out.flush()
            last = lines
        if job["status"] in TERMINAL:
            break
        time.sleep(args.poll)
    if listener is not None:
        listener.report(out)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    saved = 0
    for t in job["tracks"]:
        if t["status"] != "done":
            print(f"track {t['index']}: {t['status']}: {t.get('error') or ''}".rstrip(": "), file=out)
            continue
        for kind in args.formats.split(","):
            print(save(client, job_id, t, kind, args.loudness, out_dir), file=out)
            saved += 1
    print(f"job {job_id}: {job['status']}", file=out)
    return 0 if job["status"] == "completed" else 1


def status(_: argparse.Namespace, client: httpx.Client, out: TextIO = sys.stdout) -> int:
    s = _check(client.get("/status"))
    print(
        f"{s['idle_gpus']}/{s['total_gpus']} workers idle, {s['active_jobs']} active jobs, {s['queued_jobs']} queued",
        file=out,
    )
    print(f"{'id':>3}  {'status':<8} {'phase':<17} {'device':<7} url", file=out)
    for w in s["workers"]:
        print(
            f"{w['worker_id']:>3}  {w['status']:<8} {w['phase']:<17} {str(w.get('device') or '-'):<7} {w['url']}",
            file=out,
        )
    return 0


DEFAULT_SERVER = "http://127.0.0.1:8889"


def parser() -> argparse.ArgumentParser:
    """Every option with its help; ``songserve --help`` and ``songserve generate --help`` print them."""
    ap = argparse.ArgumentParser(
        prog="songserve",
        description="songserve command-line client (also: python -m songserve). Talks to a running dispatcher.",
        epilog="Environment: SONGSERVE_URL (the dispatcher, instead of --server), "
        "SONGSERVE_API_KEY (its API key, instead of --api-key).",
    )
    ap.add_argument(
        "--server",
        default=os.environ.get("SONGSERVE_URL", DEFAULT_SERVER),
        help=f"the dispatcher's URL (default: $SONGSERVE_URL, else {DEFAULT_SERVER})",
    )
    ap.add_argument(
        "--api-key",
        default=os.environ.get("SONGSERVE_API_KEY"),
        help="sent as Authorization: Bearer <key> (default: $SONGSERVE_API_KEY; none when unset)",
    )
    sub = ap.add_subparsers(dest="command", required=True, metavar="{generate,status,adapters,mcp}", help="what to do")
    g = sub.add_parser("generate", help="submit a job, show progress, download the files")
    g.add_argument("--lyrics-file", metavar="FILE", help="read the lyrics from FILE (UTF-8; [verse], [chorus] …)")
    g.add_argument("--lyrics", metavar="TEXT", help="the lyrics on the command line (instead of --lyrics-file)")
    g.add_argument("--tags", help='the style as tags, e.g. "pop, piano" (see GET /tags)')
    g.add_argument("--prompt", help="a description instead of tags")
    g.add_argument("--instrumental", action="store_true", help="no vocals (lyrics are not sung)")
    g.add_argument(
        "--duration",
        type=float,
        metavar="MINUTES",
        help="song length in minutes (default: the server's, 3; a retake: the original's; "
        "a continued upload: its length plus 30 s, at least 1)",
    )
    g.add_argument("--tracks", type=int, default=2, metavar="N", help="takes of the song to make (default 2)")
    g.add_argument("--seed", type=int, help="seed of take 0 (take i uses seed + i); default: the server picks")
    g.add_argument("--out", default="songs", metavar="DIR", help="folder the files are saved in (default songs/)")
    g.add_argument(
        "--formats",
        default="mp3,wav",
        metavar="LIST",
        help="comma-separated, of mp3, wav, codes, flac, opus (default mp3,wav)",
    )
    g.add_argument("--loudness", type=float, help="LUFS for the flac/opus downloads (EBU R128); unset: as made")
    g.add_argument(
        "--continue",
        dest="cont",
        metavar="JOB:TRACK@[-]SEC[-END]",
        help=(
            "retake a finished take from SEC on (with -END: repaint the part from SEC to END; A-B,C-D: repaint "
            "those parts; @-SEC: a new opening)"
        ),
    )
    g.add_argument(
        "--continue-audio", dest="cont_audio", metavar="FILE[@SEC]", help="upload your audio, continue it from SEC on"
    )
    g.add_argument("--listen", metavar="FILE", help="write take 0 to FILE as it is made (.wav or MP3; - = stdout)")
    g.add_argument(
        "--poll", type=float, default=0.5, metavar="SEC", help="seconds between progress checks (default 0.5)"
    )
    g.add_argument("--adapter", metavar="NAME[@SCALE]", help="a LoRA adapter for every take (songserve adapters)")
    g.add_argument(
        "--adapters", metavar="A,B@0.5,none", help="each take's own adapter (none: the base model); sets --tracks"
    )
    sub.add_parser("status", help="show the workers and the queue")
    a = sub.add_parser("adapters", help="list the LoRA adapters the workers can load; upload or delete your own")
    acts = a.add_subparsers(dest="action", metavar="{upload,delete}", help="without one: list them")
    up = acts.add_parser("upload", help="upload a PEFT adapter folder (adapter_config.json, adapter_model.safetensors)")
    up.add_argument("dir", metavar="DIR", help="the adapter's folder")
    up.add_argument("--name", help="its name in the fleet (default: the folder's name)")
    rm = acts.add_parser("delete", help="delete one of your uploaded adapters, here and on every worker")
    rm.add_argument("name", metavar="NAME")
    sub.add_parser("mcp", help="serve the dispatcher's MCP tools on stdin/stdout, for desktop clients (docs/mcp.md)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.command == "mcp":  # the protocol owns stdout from here
        from songserve.cli.mcp_stdio import main as serve_mcp

        return serve_mcp(args.server, args.api_key)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        limits = httpx.Limits(keepalive_expiry=CLIENT_KEEPALIVE_SEC)
        with httpx.Client(base_url=args.server, headers=headers, timeout=30, limits=limits) as client:
            out = sys.stderr if getattr(args, "listen", None) == "-" else sys.stdout  # stdout carries the audio
            return {"generate": generate, "status": status, "adapters": adapters}[args.command](args, client, out)
    except ClientError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (httpx.ConnectError, httpx.ConnectTimeout, httpx.UnsupportedProtocol) as exc:
        print(
            f"error: cannot reach {args.server} ({exc}): is the dispatcher running (bash run_backend.sh)? "
            "Name another with --server URL or SONGSERVE_URL.",
            file=sys.stderr,
        )
        return 1
    except httpx.HTTPError as exc:
        print(f"error: {args.server}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
