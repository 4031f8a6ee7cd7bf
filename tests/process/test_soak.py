"""A soak: a seeded random mix of everything a busy fleet is asked, on two tiny-model workers.

One dispatcher (our port and the ACE-Step port) over two real workers on the tiny set, all real
processes on loopback. A fixed seed draws the plan — generates of one or two takes (vocal and
instrumental), retakes of the same take again and again, repaints of a part and new openings, one
repaint of two parts in one request, takes on four LoRA adapters and one uploaded through
``POST /adapters`` over two slots per worker,
uploads continued several times, cancels,
renders in every format, live MP3 listeners that hang up after 0.3-1.2 s, ACE-Step tasks — and a few
threads carry it out at once, so the order of events differs from run to run while the plan does not.

What must hold whatever the interleaving:
- every accepted job ends; none fails but what was cancelled;
- the dispatcher and both workers are alive, and no worker's log holds a traceback;
- every retake and continuation keeps its prefix: the first frames of its code grid are the
  original's (or the upload's), all 64 levels; every repaint keeps the original outside the frames
  it wrote anew (each part's, and between them), and every opening keeps the original after its join;
- each worker's memory stays flat: its RSS after each step, less what its KV snapshot cache and its
  kept audio say they hold (caches bounded by ``KV_SNAPSHOT_MB`` and ``EDIT_AUDIO_MB``), grows by at most ``GROWTH_MB`` from the end of the
  first third of the steps (the warm-up: models touched, first windows decoded) to the end, and by
  at most ``LAST_THIRD_MB`` over the last third.

``SOAK_STEPS`` runs a longer soak by hand (``SOAK_STEPS=240 bash scripts/test tests/process/test_soak.py -s``);
the memory figures are printed either way.
"""

from __future__ import annotations

import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from songserve.audio import codes
from songserve.pipeline.adapters.format import CONFIG, WEIGHTS
from songserve.pipeline.tiny.adapters import write_tiny_adapters
from songserve.pipeline.tiny.build import tiny_arch
from tests.support.audio import music, wav_bytes
from tests.support.http import TLS
from tests.support.servers import Cluster, cluster_of, free_port, start_worker, wait_for

SEED = 20261203
STEPS = int(os.environ.get("SOAK_STEPS", "48"))
GROWTH_MB = 150.0  # RSS less the snapshot cache, warm-up to end
LAST_THIRD_MB = 60.0  # the same over the last third: not still rising
THREADS = 4
WAIT = 900.0  # seconds for the whole fleet to go quiet: generous, CI machines are shared
TERMINAL = {"completed", "partial", "failed", "cancelled"}
SONG_MIN = (0.1, 0.15, 0.2)  # minutes: 6 to 12 s of audio, a second or two of tiny-set work each


@dataclass
class Ledger:
    """What the soak asked for and what it expects of each job."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    jobs: dict[str, str] = field(default_factory=dict)  # job id -> kind (generate, retake, upload, cancel, acestep)
    cancelled: set[str] = field(default_factory=set)
    origins: dict[str, tuple[str, str | int, int]] = field(default_factory=dict)  # retake -> (kind, source, frames)
    edits: dict[str, str] = field(default_factory=dict)  # repaint or opening -> its source take "job/index"
    adapters: dict[str, list[str | None]] = field(default_factory=dict)  # job -> each take's LoRA adapter
    done_takes: list[tuple[str, int]] = field(default_factory=list)
    uploads: list[str] = field(default_factory=list)
    renders: list[int] = field(default_factory=list)
    listeners: int = 0
    notes: list[str] = field(default_factory=list)
    memory: list[list[float]] = field(
        default_factory=list
    )  # per finished step: each worker's RSS less its snapshots, MB

    def add(self, job_id: str, kind: str) -> None:
        with self.lock:
            self.jobs[job_id] = kind


@pytest.fixture(scope="module")
def fleet(tiny_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("soak")
    adapters = write_tiny_adapters(tmp / "adapters", {k: tiny_arch(k, 1024) for k in ("backbone", "superres")})
    workers = [
        start_worker(
            tmp,
            "--checkpoints-dir",
            str(tiny_dir),
            "--adapters-dir",
            str(adapters),
            "--max-adapters",
            "2",
            name=f"tiny{i}",
        )
        for i in range(2)
    ]
    for w in workers:
        w.wait_healthy(timeout=300)
    ace = free_port()
    c = cluster_of(tmp, workers, "--acestep-port", str(ace))
    c.ace = f"http://127.0.0.1:{ace}"
    files = {f: (n, (adapters / "tiny-c" / n).read_bytes()) for f, n in (("config", CONFIG), ("weights", WEIGHTS))}
    up = httpx.post(f"{c.url}/adapters", data={"name": UPLOADED}, files=files, timeout=120, verify=TLS)
    assert up.status_code == 201, up.text
    assert sorted(up.json()["workers"]) == [0, 1]
    yield c
    c.stop()


def _post(fleet: Cluster, ledger: Ledger, kind: str, **body) -> str | None:
    r = httpx.post(f"{fleet.url}/generate", json=body, timeout=30, verify=TLS)
    if r.status_code == 429:  # a full queue is an answer, not a failure: nothing was accepted
        ledger.notes.append(f"{kind}: 429")
        return None
    assert r.status_code == 200, (kind, body, r.text)
    job_id = str(r.json()["job_id"])
    ledger.add(job_id, kind)
    return job_id


def _wait(fleet: Cluster, job_id: str) -> dict:
    return wait_for(lambda: (j := fleet.job(job_id)) and j["status"] in TERMINAL and j, timeout=WAIT, interval=0.25)


def _song(rng: random.Random) -> dict:
    instrumental = rng.random() < 0.3
    return {
        "tags": rng.choice(["pop, piano", "rock", "jazz, saxophone"]),
        "lyrics": "" if instrumental else "[verse]\nround and round\nthe soak goes on",
        "mode": "instrumental" if instrumental else "vocal",
        "duration": rng.choice(SONG_MIN),
        "seed": rng.randrange(1, 10_000),
    }


def _finished(fleet: Cluster, ledger: Ledger, job_id: str | None) -> None:
    if job_id is None:
        return
    view = _wait(fleet, job_id)
    with ledger.lock:
        ledger.done_takes.extend((job_id, t["index"]) for t in view["tracks"] if t["status"] == "done")


def op_generate(fleet: Cluster, ledger: Ledger, rng: random.Random) -> None:
    _finished(fleet, ledger, _post(fleet, ledger, "generate", **_song(rng), num_tracks=rng.choice([1, 2])))


def op_retake(fleet: Cluster, ledger: Ledger, rng: random.Random) -> None:
    with ledger.lock:
        takes = list(ledger.done_takes)
    if not takes:
        return op_generate(fleet, ledger, rng)
    job_id, index = takes[0] if rng.random() < 0.5 else rng.choice(takes)  # the same take, again and again
    seconds = fleet.job(job_id)["tracks"][index]["duration_sec"]
    at = round(rng.uniform(1.0, max(1.5, seconds - 1.5)), 2)
    new = _post(
        fleet,
        ledger,
        "retake",
        continue_from={"job_id": job_id, "track_index": index, "at_sec": at},
        num_tracks=rng.choice([1, 2]),
        seed=rng.randrange(1, 10_000),
    )
    if new is not None:
        with ledger.lock:
            ledger.origins[new] = ("take", f"{job_id}/{index}", int(at * 44100 // 2048))
    _finished(fleet, ledger, new)


def op_edit(fleet: Cluster, ledger: Ledger, rng: random.Random) -> None:
    """A repaint of a second or two inside a finished take, or a new opening of one to three seconds."""
    with ledger.lock:
        takes = list(ledger.done_takes)
    if not takes:
        return op_generate(fleet, ledger, rng)
    job_id, index = rng.choice(takes)
    seconds = fleet.job(job_id)["tracks"][index]["duration_sec"]
    cf: dict = {"job_id": job_id, "track_index": index}
    if rng.random() < 0.6:
        at = round(rng.uniform(1.0, seconds - 3.0), 2)
        cf |= {"at_sec": at, "end_sec": round(at + rng.uniform(1.0, 2.0), 2)}
    else:
        cf["before_sec"] = round(rng.uniform(1.0, 3.0), 2)
    new = _post(fleet, ledger, "edit", continue_from=cf, num_tracks=rng.choice([1, 2]), seed=rng.randrange(1, 10_000))
    if new is not None:
        with ledger.lock:
            ledger.edits[new] = f"{job_id}/{index}"
    _finished(fleet, ledger, new)


def op_parts(fleet: Cluster, ledger: Ledger, rng: random.Random) -> None:
    """A repaint of two parts of a second each of a finished take, in one request (the plan holds one)."""
    job_id, index = rng.choice(wait_for(lambda: list(ledger.done_takes), timeout=WAIT))
    at = round(rng.uniform(0.5, 1.5), 2)  # the second part starts 1.5 s after the first ends: past its join window
    parts = [{"at_sec": at, "end_sec": at + 1.0}, {"at_sec": at + 2.5, "end_sec": at + 3.5}]
    cf = {"job_id": job_id, "track_index": index, "parts": parts}
    new = _post(fleet, ledger, "parts", continue_from=cf, num_tracks=rng.choice([1, 2]), seed=rng.randrange(1, 10_000))
    if new is not None:
        with ledger.lock:
            ledger.edits[new] = f"{job_id}/{index}"
    _finished(fleet, ledger, new)


UPLOADED = "uploaded-c"  # the tiny set's tiny-c, uploaded through POST /adapters when the fleet starts
# four folder adapters and an upload on two slots per worker, and none
ADAPTERS = ("tiny-a", "tiny-b", "tiny-c", "tiny-sr", UPLOADED, None)


def op_adapters(fleet: Cluster, ledger: Ledger, rng: random.Random) -> None:
    """A song whose takes are made on LoRA adapters drawn from the tiny set's four and an upload (or none)."""
    chosen = [rng.choice(ADAPTERS) for _ in range(rng.choice([1, 2]))]
    takes = [{"adapter": a, "adapter_scale": round(rng.uniform(0.2, 2.0), 2)} for a in chosen]
    new = _post(fleet, ledger, "adapters", **_song(rng), num_tracks=len(takes), takes=takes)
    if new is not None:
        with ledger.lock:
            ledger.adapters[new] = chosen
    _finished(fleet, ledger, new)


def op_upload(fleet: Cluster, ledger: Ledger, rng: random.Random) -> None:
    with ledger.lock:
        known = list(ledger.uploads)
    if known and rng.random() < 0.6:
        upload_id = rng.choice(known)  # the same upload continued again
    else:
        data = wav_bytes(music(rng.uniform(3.0, 5.0), seed=rng.randrange(1000)))
        r = httpx.post(f"{fleet.url}/uploads", files={"file": ("soak.wav", data, "audio/wav")}, timeout=60, verify=TLS)
        assert r.status_code == 200, r.text
        upload_id = r.json()["upload_id"]
        with ledger.lock:
            ledger.uploads.append(upload_id)
    body = _song(rng)
    body["duration"] = 0.2
    new = _post(fleet, ledger, "upload", **body, continue_from={"upload_id": upload_id}, num_tracks=rng.choice([1, 2]))
    if new is not None:
        with ledger.lock:
            ledger.origins[new] = ("upload", upload_id, -1)
    _finished(fleet, ledger, new)


def op_cancel(fleet: Cluster, ledger: Ledger, rng: random.Random) -> None:
    job_id = _post(fleet, ledger, "cancel", **_song(rng), num_tracks=2)
    if job_id is None:
        return
    time.sleep(rng.uniform(0.0, 1.5))
    r = httpx.delete(f"{fleet.url}/job/{job_id}", timeout=30, verify=TLS)
    assert r.status_code == 200, r.text
    with ledger.lock:
        ledger.cancelled.add(job_id)
    _wait(fleet, job_id)


def op_render(fleet: Cluster, ledger: Ledger, rng: random.Random) -> None:
    with ledger.lock:
        takes = list(ledger.done_takes)
    if not takes:
        return op_generate(fleet, ledger, rng)
    job_id, index = rng.choice(takes)
    params = {"format": rng.choice(["flac", "opus", "mp3", "wav"]), "loudness": rng.choice([-23, -16, -14])}
    r = httpx.get(f"{fleet.url}/job/{job_id}/track/{index}/render", params=params, timeout=120, verify=TLS)
    assert r.status_code in (200, 429, 503), (job_id, params, r.status_code, r.text[:300])
    if r.status_code != 200:
        assert "Retry-After" in r.headers, r.headers
    with ledger.lock:
        ledger.renders.append(r.status_code)


def op_listen(fleet: Cluster, ledger: Ledger, rng: random.Random) -> None:
    """A listener on a track being made that hangs up, as a closed browser tab does."""
    job_id = _post(fleet, ledger, "generate", **_song(rng), num_tracks=1)
    if job_id is None:
        return
    listeners = []
    for _ in range(rng.randint(2, 5)):
        listeners.append(threading.Thread(target=_hang_up, args=(fleet, job_id, rng.uniform(0.3, 1.2))))
    for t in listeners:
        t.start()
    for t in listeners:
        t.join(60)
    with ledger.lock:
        ledger.listeners += len(listeners)
    _finished(fleet, ledger, job_id)


def _hang_up(fleet: Cluster, job_id: str, after: float) -> None:
    deadline = time.monotonic() + after
    try:
        with httpx.stream("GET", f"{fleet.url}/job/{job_id}/track/0/stream", timeout=30, verify=TLS) as r:
            for _ in r.iter_raw(4096):
                if time.monotonic() > deadline:
                    break
    except httpx.HTTPError:
        pass  # the dispatcher may end the stream first (a short take); only its survival is asserted


def op_acestep(fleet: Cluster, ledger: Ledger, rng: random.Random) -> None:
    body = {
        "prompt": rng.choice(["pop, piano", "a calm song for a rainy day"]),
        "lyrics": rng.choice(["[inst]", "[verse]\nace step in the soak"]),
        "audio_duration": rng.choice([6, 9]),
        "batch_size": rng.choice([1, 2]),
        "audio_format": rng.choice(["mp3", "flac"]),
    }
    r = httpx.post(fleet.ace + "/release_task", json=body, timeout=30, verify=TLS)
    assert r.status_code == 200, r.text
    task_id = r.json()["data"]["task_id"]
    ledger.add(task_id, "acestep")
    _finished(fleet, ledger, task_id)
    result = httpx.post(fleet.ace + "/query_result", json={"task_id_list": [task_id]}, timeout=30, verify=TLS)
    assert result.json()["data"][0]["status"] == 1, result.text


def _memory_mb(worker) -> float:
    """The worker's RSS less the bytes its KV snapshot cache and its kept audio hold (on the CPU, host
    memory), in MB."""
    health = httpx.get(worker.url + "/health", timeout=30, verify=TLS).json()
    snapshots = (health.get("kv_snapshots") or {}).get("bytes", 0)
    kept = (health.get("kept_audio") or {}).get("bytes", 0)
    return float(health["rss_mb"]) - (snapshots + kept) / 2**20


OPS = [
    (op_generate, 3),
    (op_retake, 4),
    (op_edit, 3),
    (op_adapters, 2),
    (op_upload, 3),
    (op_cancel, 2),
    (op_render, 3),
    (op_listen, 2),
    (op_acestep, 2),
]


def test_a_seeded_mix_of_everything_ends_every_job_and_keeps_every_prefix(fleet):
    plan_rng = random.Random(SEED)
    kinds, weights = zip(*OPS, strict=True)
    plan = [(plan_rng.choices(kinds, weights)[0], plan_rng.randrange(2**31)) for _ in range(STEPS)]
    plan[:2] = [(op_generate, 1), (op_generate, 2)]  # takes to retake and render from the start
    plan[STEPS // 2] = (op_parts, plan[STEPS // 2][1])  # one repaint of two parts, amid the rest
    ledger = Ledger()
    errors: list[str] = []

    def run(step: tuple) -> None:
        op, seed = step
        try:
            op(fleet, ledger, random.Random(seed))
        except Exception as e:  # collected and asserted below, with every other step's
            errors.append(f"{op.__name__}: {type(e).__name__}: {e}")
        sample = [_memory_mb(w) for w in fleet.workers]
        with ledger.lock:
            ledger.memory.append(sample)

    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(run, plan))
    assert not errors, "\n".join(errors)

    # Every accepted job ended; none failed but what was cancelled.
    views = {job_id: _wait(fleet, job_id) for job_id in ledger.jobs}
    for job_id, view in views.items():
        if job_id in ledger.cancelled:
            assert view["status"] in {"cancelled", "completed"}, view
            continue
        failed = [t for t in view["tracks"] if t["status"] != "done"]
        assert view["status"] == "completed", (ledger.jobs[job_id], view)
        assert not failed, (ledger.jobs[job_id], view)

    # Every retake and continuation kept its prefix, all 64 levels.
    for job_id, (kind, source, frames) in ledger.origins.items():
        if job_id not in views:
            continue
        if kind == "upload":
            origin = codes.decode(httpx.get(f"{fleet.url}/uploads/{source}/codes", timeout=30, verify=TLS).content)
            frames = origin.frames
        else:
            src_job, src_index = str(source).split("/")
            origin = codes.decode(
                httpx.get(f"{fleet.url}/job/{src_job}/track/{src_index}/codes", timeout=30, verify=TLS).content
            )
        for track in views[job_id]["tracks"]:
            grid = codes.decode(
                httpx.get(f"{fleet.url}/job/{job_id}/track/{track['index']}/codes", timeout=30, verify=TLS).content
            )
            assert grid.levels == 64, (job_id, grid.levels)
            assert grid.frames > frames, (job_id, grid.frames, frames)
            assert (grid.codes[:, :frames] == origin.codes[:, :frames]).all(), (job_id, kind, source)

    # Every repaint kept the original outside its new frames; every opening kept it after its join.
    for job_id, source in ledger.edits.items():
        src_job, src_index = source.split("/")
        origin = codes.decode(
            httpx.get(f"{fleet.url}/job/{src_job}/track/{src_index}/codes", timeout=30, verify=TLS).content
        )
        for track in views[job_id]["tracks"]:
            span = track["metadata"]["repainted"]
            grid = codes.decode(
                httpx.get(f"{fleet.url}/job/{job_id}/track/{track['index']}/codes", timeout=30, verify=TLS).content
            )
            start, join, room = span["start_frame"], span["join_frame"], span["opening"]
            assert grid.frames == origin.frames + room, (job_id, grid.frames, origin.frames, span)
            assert (grid.codes[:, :start] == origin.codes[:, :start]).all(), (job_id, span)
            assert (grid.codes[:, join:] == origin.codes[:, join - room :]).all(), (job_id, span)
            parts = span.get("parts") or []
            for a, b in zip(parts, parts[1:], strict=False):  # between two parts: the original's
                between = slice(a["join_frame"], b["start_frame"])
                assert (grid.codes[:, between] == origin.codes[:, between]).all(), (job_id, span)

    # Every take was made on the adapter it asked for (none: the base model), whichever worker and slot.
    for job_id, chosen in ledger.adapters.items():
        made = [(t["metadata"].get("adapter") or {}).get("name") for t in views[job_id]["tracks"]]
        assert made == chosen, (job_id, made, chosen)

    # The fleet is whole: every process alive, answering, and no traceback in a worker's log.
    assert httpx.get(fleet.url + "/health", timeout=10, verify=TLS).status_code == 200
    assert httpx.get(fleet.ace + "/health", timeout=10, verify=TLS).status_code == 200
    for w in fleet.workers:
        assert w.proc.poll() is None, w.log_tail()
        assert "Traceback" not in Path(w.log_path).read_text(errors="replace"), w.log_tail()
    assert fleet.api is not None
    assert fleet.api.proc.poll() is None

    # Each worker's memory, less its snapshot cache: flat after the warm-up, and not rising at the end.
    warm, late = ledger.memory[STEPS // 3 - 1], ledger.memory[2 * STEPS // 3 - 1]
    end = [_memory_mb(w) for w in fleet.workers]  # every job has ended: no batch's tensors in it
    figures = [f"worker {i}: {warm[i]:.0f} -> {late[i]:.0f} -> {end[i]:.0f} MB" for i in range(len(end))]
    print(f"\nsoak memory (RSS less KV snapshots, after steps {STEPS // 3}, {2 * STEPS // 3}, {STEPS}): {figures}")
    for i in range(len(end)):
        assert end[i] - warm[i] <= GROWTH_MB, figures
        assert end[i] - late[i] <= LAST_THIRD_MB, figures
    kinds_run = sorted(set(ledger.jobs.values()))
    print(
        f"\nsoak: {len(ledger.jobs)} jobs ({kinds_run}), {len(ledger.origins)} retakes/continuations, "
        f"{len(ledger.edits)} repaints/openings, {len(ledger.adapters)} on adapters, "
        f"{len(ledger.renders)} renders {sorted(set(ledger.renders))}, {ledger.listeners} listeners hung up, "
        f"{len(ledger.cancelled)} cancels; {ledger.notes}"
    )
    assert {"retake", "upload", "acestep", "parts"} <= set(kinds_run)
