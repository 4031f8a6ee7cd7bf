"""P11: dispatchers on one PostgreSQL job store: 2 dispatchers vs 1, and PostgreSQL vs SQLite.

Every figure is a ratio of rates measured in the same run (configurations alternated, best of the rounds,
as P2 does):
  - ``GET /job/{id}`` and ``POST /generate`` requests/s: 2 dispatchers on one PostgreSQL database (a wrk
    against each, concurrently, summed) vs 1 dispatcher on it; 1 dispatcher on PostgreSQL vs on SQLite.
    The jobs read are finished 1-track jobs, made through test-pipeline workers and the dispatcher itself
    (so the store's own write path made them, on either engine); the measured dispatchers have no workers,
    so every read comes from the store and every submission stays queued (the queue cap is lifted).
  - P1's per-track overhead (submit → done → download through the dispatcher, minus the same calls made
    to the worker directly), on PostgreSQL and on SQLite; the ms PostgreSQL adds per track.

The PostgreSQL parts need the PostgreSQL engine (``STORE_URL``); where no server can be started (tests/support/pg.py)
or the dispatcher does not use ``STORE_URL``, the SQLite parts run alone and the line says why.

``--smoke``: every part once on tiny inputs (4 jobs, 0.2 s of load per configuration, 1 track), no warm-ups.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import os
import random
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from bench.common import args, median, report, timed_load
from bench.p1_dispatcher_overhead import direct, through_dispatcher
from tests.support.servers import ServerProcess, free_port, start_worker

if TYPE_CHECKING:
    from tests.support.pg import PgServer

DURATION = 0.001  # minutes: the tracks' own work stays negligible (as in P1)
SUBMIT = {"lyrics": "la la", "tags": "pop", "duration": DURATION, "num_tracks": 1}
CONNS = 32  # per load generator, as P2


@dataclass
class Store:
    """Where a dispatcher keeps its jobs: SQLite under its state folder, or a PostgreSQL URL shared by several."""

    name: str
    url: str = ""  # empty: SQLite

    def env(self, dispatcher_id: str, results: Path) -> dict[str, str]:
        if not self.url:
            return {}
        return {"STORE_URL": self.url, "DISPATCHER_ID": dispatcher_id, "RESULTS_DIR": str(results)}


def start_dispatcher(
    tmp: Path, name: str, store: Store, workers: Sequence[ServerProcess] = (), results: Path | None = None
) -> ServerProcess:
    """One dispatcher with its own state folder; with PostgreSQL its results folder is shared (RESULTS_DIR)."""
    port = free_port()
    urls = ",".join(w.url for w in workers)
    argv = [
        "backend_api.py",
        "--port",
        str(port),
        "--state-dir",
        str(tmp / f"state_{name}"),
        "--health-interval",
        "0.2",
        "--min-duration",
        str(DURATION),
        "--max-queue",
        "100000000",
        "--log-level",
        "WARNING",
        *(("--worker-urls", urls) if urls else ("--num-workers", "0")),
    ]
    env = store.env(f"p11-{name}", results or tmp / f"results_{store.name}")
    p = ServerProcess(argv, port, tmp / f"{name}.log", env)
    p.wait_healthy(timeout=300, want=("ok",))
    if workers:
        deadline = time.monotonic() + 60
        with httpx.Client(base_url=p.url, timeout=10) as http:  # one connection: a bare httpx.get costs ~30 ms CPU
            while http.get("/status").json()["idle_gpus"] != len(workers):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name}: workers not idle:\n{p.log_tail()}")
                time.sleep(0.05)
    return p


def pg_tables(url: str) -> int:
    """Tables the dispatcher created in the PostgreSQL database: 0 means it did not use STORE_URL."""
    import psycopg

    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM information_schema.tables"
            " WHERE table_schema NOT IN ('pg_catalog', 'information_schema')"
        ).fetchone()
    return int(row[0]) if row else 0


def seed(d: ServerProcess, n: int) -> list[str]:
    """n finished 1-track jobs made through dispatcher d and its workers; their ids."""
    ids: list[str] = []

    def client(k: int) -> list[str]:
        got = []
        with httpx.Client(base_url=d.url, timeout=30) as http:
            while len(got) < k:
                r = http.post("/generate", json=SUBMIT)
                r.raise_for_status()
                got.append(r.json()["job_id"])
        return got

    clients = 8
    with cf.ThreadPoolExecutor(clients) as pool:
        for got in pool.map(client, [n // clients + (1 if i < n % clients else 0) for i in range(clients)]):
            ids += got
    deadline = time.monotonic() + 900
    with httpx.Client(base_url=d.url, timeout=10) as http:
        while time.monotonic() < deadline:
            st = http.get("/status").json()
            if st["queued_tracks"] == 0 and st["running_tracks"] == 0:
                return ids
            time.sleep(0.2)
    raise TimeoutError(f"seeding did not finish:\n{d.log_tail()}")


# ---- load generation ---------------------------------------------------------------------------------------


def ensure_wrk(install: bool) -> bool:
    """wrk on PATH, installing Debian's package when allowed (as bench/run_all.sh does); False: use Python."""
    if shutil.which("wrk"):
        return True
    if install and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for cmd in (["apt-get", "install", "-y", "-qq", "wrk"], ["apt-get", "update", "-qq"]):
            subprocess.run(cmd, env=env, capture_output=True, timeout=600)
            if shutil.which("wrk"):
                return True
        subprocess.run(["apt-get", "install", "-y", "-qq", "wrk"], env=env, capture_output=True, timeout=600)
    return shutil.which("wrk") is not None


def lua_script(tmp: Path, kind: str, ids: list[str]) -> Path:
    path = tmp / f"{kind}.lua"
    if kind == "get":
        listed = ",".join(f'"{i}"' for i in ids)
        path.write_text(
            f"ids = {{{listed}}}\nrequest = function()\n"
            '  return wrk.format("GET", "/job/" .. ids[math.random(#ids)])\nend\n'
        )
    else:
        body = httpx.Request("POST", "http://x", json=SUBMIT).content.decode()
        path.write_text(
            'wrk.method = "POST"\n'
            f"wrk.body = [[{body}]]\n"
            'wrk.headers["Content-Type"] = "application/json"\n'
            'request = function()\n  return wrk.format("POST", "/generate")\nend\n'
        )
    return path


def wrk_many(urls: list[str], script: Path, seconds: float) -> float:
    """One wrk per dispatcher, all at once; their requests/s summed. Any non-2xx answer is an error."""
    procs = [
        subprocess.Popen(
            ["wrk", "-t1", f"-c{CONNS}", f"-d{max(1, round(seconds))}s", "-s", str(script), url],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for url in urls
    ]
    total = 0.0
    for p in procs:
        out, _ = p.communicate(timeout=seconds + 60)
        if p.returncode != 0 or "Non-2xx" in out or "Requests/sec" not in out:
            raise RuntimeError(f"wrk saw errors:\n{out}")
        total += float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    return total


async def python_load(url: str, kind: str, ids: list[str], seconds: float, conns: int = 16) -> float:
    """The fallback without wrk (as P2's): asyncio + httpx, fixed time."""

    async def one(http: httpx.AsyncClient, rng: random.Random) -> None:
        if kind == "get":
            r = await http.get(f"/job/{rng.choice(ids)}")
        else:
            r = await http.post("/generate", json=SUBMIT)
        r.raise_for_status()

    return await timed_load(url, one, seconds, conns, timeout=30)


def rate(urls: list[str], kind: str, ids: list[str], seconds: float, tmp: Path, use_wrk: bool) -> float:
    if use_wrk:
        return wrk_many(urls, lua_script(tmp, kind, ids), seconds)

    async def all_at_once() -> float:
        return sum(await asyncio.gather(*(python_load(u, kind, ids, seconds) for u in urls)))

    return asyncio.run(all_at_once())


# ---- the figures -------------------------------------------------------------------------------------------


@contextmanager
def postgres(why_not: list[str]) -> Iterator[PgServer | None]:
    """A throw-away PostgreSQL server (tests/support/pg.py), or None with the reason appended to why_not."""
    from tests.support import pg

    reason = pg.unavailable()
    if reason:
        why_not.append(reason)
        yield None
        return
    with pg.server() as server:
        yield server


def reads(
    tmp: Path,
    configs: dict[str, list[str]],
    ids: dict[str, list[str]],
    secs: float,
    rounds: int,
    use_wrk: bool,
    warm: float = 1.0,
) -> dict[str, float]:
    """Best GET /job/{id} requests/s of each configuration (alternated each round) on the seeded stores,
    after ``warm`` seconds of untimed load on each (a fresh process's first second is slow)."""
    best: dict[str, float] = {}
    for name, urls in configs.items() if warm else ():
        rate(urls, "get", ids[name], warm, tmp, use_wrk)
    for _ in range(rounds):
        for name, urls in configs.items():
            best[name] = max(best.get(name, 0.0), rate(urls, "get", ids[name], secs, tmp, use_wrk))
    return best


def submissions(
    tmp: Path, names: list[str], pg: PgServer | None, secs: float, rounds: int, use_wrk: bool, warm: int = 10
) -> tuple[dict[str, float], dict[str, int]]:
    """Best POST /generate requests/s of each configuration, each measured from an empty queue (fresh
    dispatchers on a fresh store): a submission's cost grows with the queued tracks, so configurations
    compared at different queue depths would measure the depth. Also the tracks queued at the end.
    ``warm`` untimed submissions to each dispatcher first."""
    best: dict[str, float] = {}
    depth: dict[str, int] = {}
    for r in range(rounds):
        for name in names:
            tag = f"post{r}_{name}"
            store = Store("pg", pg.url(pg.create_database())) if name != "sqlite" and pg else Store(tag)
            count = 2 if name == "pg2" else 1
            ds = [start_dispatcher(tmp, f"{tag}_{i}", store, results=tmp / f"results_{tag}") for i in range(count)]
            try:
                for d in ds:  # warm each path with a few submissions (untimed; the queue stays near empty)
                    for _ in range(warm):
                        httpx.post(d.url + "/generate", json=SUBMIT, timeout=30).raise_for_status()
                got = rate([d.url for d in ds], "post", [], secs, tmp, use_wrk)
                depth[name] = max(httpx.get(d.url + "/status").json()["queued_tracks"] for d in ds)
            finally:
                for d in ds:
                    d.stop()
            best[name] = max(best.get(name, 0.0), got)
    return best, depth


def overhead(
    tmp: Path, stores: list[Store], workers: list[ServerProcess], n: int, warm: int = 2
) -> tuple[dict[str, float], float]:
    """P1's method on each store: median through-dispatcher time per track minus the direct median (ms),
    after ``warm`` untimed tracks on every path."""
    ds = {s.name: start_dispatcher(tmp, f"p1_{s.name}", s, [w]) for s, w in zip(stores, workers, strict=False)}
    times: dict[str, list[float]] = {name: [] for name in ds}
    base: list[float] = []
    clients = {name: httpx.Client(base_url=d.url, timeout=60) for name, d in ds.items()}
    first = next(iter(ds))
    try:
        for i in range(n + warm):
            for name, http in clients.items():  # interleaved: drift hits each alike
                t = through_dispatcher(http, None)  # type: ignore[arg-type]  # P1's method; it uses http only
                if i >= warm:
                    times[name].append(t)
            t = direct(clients[first], workers[0].url, 1000 + i)
            if i >= warm:
                base.append(t)
    finally:
        for http in clients.values():
            http.close()
        for d in ds.values():
            d.stop()
    mb = median(base)
    return {name: (median(ts) - mb) * 1000 for name, ts in times.items()}, mb * 1000


def main() -> None:
    a = args(__doc__, jobs=1000, seconds=5.0, post_seconds=2.0, rounds=2, tracks=40)
    n, secs, post_secs, rounds, tracks = (
        (4, 0.2, 0.2, 1, 1) if a.smoke else (a.jobs, a.seconds, a.post_seconds, a.rounds, a.tracks)
    )
    warm = (0.0, 0, 0) if a.smoke else (1.0, 10, 2)  # reads' seconds, submissions, tracks
    use_wrk = ensure_wrk(install=not a.smoke)
    why_not: list[str] = []
    with tempfile.TemporaryDirectory() as tmp_name, ExitStack() as stack:
        tmp = Path(tmp_name)
        sqlite = Store("sqlite")
        pg = stack.enter_context(postgres(why_not))
        stores = [sqlite]
        if pg is not None:
            store_pg = Store("pg", pg.url(pg.create_database()))
            stores.append(store_pg)
        workers = [start_worker(tmp, "--pipeline", "test", name=f"w{i}") for i in range(2)]
        for w in workers:
            stack.callback(w.stop)
        for w in workers:
            w.wait_healthy(timeout=300)

        # Seed each store through a dispatcher and the workers; check that PostgreSQL is really the store.
        ids: dict[str, list[str]] = {}
        for s in list(stores):
            d = start_dispatcher(tmp, f"seed_{s.name}", s, workers)
            try:
                if s.url and pg_tables(s.url) == 0:
                    why_not.append("the dispatcher does not use STORE_URL yet (it created no tables in PostgreSQL)")
                    stores.remove(s)
                    continue
                ids[s.name] = seed(d, n)
            finally:
                d.stop()
        on_pg = len(stores) == 2

        # The readers: no workers; SQLite reuses the seeded state folder, PostgreSQL its database.
        shutil.move(tmp / "state_seed_sqlite", tmp / "state_sqlite")
        readers = {"sqlite": start_dispatcher(tmp, "sqlite", sqlite)}
        if on_pg:
            shared = tmp / "results_pg"
            for name in ("pg_a", "pg_b"):
                readers[name] = start_dispatcher(tmp, name, store_pg, results=shared)
        for d in readers.values():
            stack.callback(d.stop)
        configs = {"sqlite": [readers["sqlite"].url]}
        if on_pg:
            configs |= {"pg1": [readers["pg_a"].url], "pg2": [readers["pg_a"].url, readers["pg_b"].url]}
            ids |= {"pg1": ids["pg"], "pg2": ids["pg"]}
        get = reads(tmp, configs, ids, secs, rounds, use_wrk, warm[0])
        for d in readers.values():
            d.stop()  # the submissions run on fresh dispatchers of their own
        post, depth = submissions(tmp, list(configs), pg if on_pg else None, post_secs, rounds, use_wrk, warm[1])

        p1_stores = [sqlite, Store("pg", pg.url(pg.create_database()))] if on_pg and pg else [sqlite]
        added, direct_ms = overhead(tmp, p1_stores, workers, tracks, warm[2])

    tool = f"wrk, {CONNS} connections each" if use_wrk else "asyncio+httpx, 16 connections each"
    setup = (
        f"{n} jobs stored; submissions from an empty queue, {post_secs:.0f} s each, up to {max(depth.values())} "
        f"tracks queued; load by {tool}"
    )
    g, p = get["sqlite"], post["sqlite"]
    sq = f"SQLite: GET /job {g:.0f} req/s, POST /generate {p:.0f} req/s, overhead +{added['sqlite']:.1f} ms per track"
    if not on_pg:
        why = "; ".join(why_not)
        report("P11", f"PostgreSQL parts not measured ({why}); {sq} (direct {direct_ms:.1f} ms); {setup}")
        return
    g1, g2, p1, p2 = get["pg1"], get["pg2"], post["pg1"], post["pg2"]
    report(
        "P11",
        f"GET /job: 2 dispatchers on PostgreSQL {g2 / g1:.2f}x one ({g2:.0f} vs {g1:.0f} req/s); "
        f"POST /generate: {p2 / p1:.2f}x ({p2:.0f} vs {p1:.0f}); "
        f"one dispatcher PostgreSQL/SQLite: GET {g1 / g:.2f}x ({g1:.0f} vs {g:.0f}), POST {p1 / p:.2f}x "
        f"({p1:.0f} vs {p:.0f}); PostgreSQL adds {added['pg'] - added['sqlite']:+.1f} ms per track "
        f"(overhead +{added['pg']:.1f} vs +{added['sqlite']:.1f} ms, direct {direct_ms:.1f} ms, {tracks} tracks); "
        f"{setup}",
    )


if __name__ == "__main__":
    main()
