"""A damaged job store is refused (one line naming the file) or moved aside, never opened quietly.

Real dispatcher processes for each kind of damage; in-process tests for the moves, the migrations
and the orphan scan.
"""

from __future__ import annotations

import asyncio
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from songserve.api.jobs.records import Job, Track
from songserve.api.jobs.states import TrackStatus
from songserve.api.results.artifacts import ArtifactStore
from songserve.api.store.migrations import Migration, migrate
from songserve.api.store.protocol import StoreError
from songserve.api.store.sqlite import migrations
from songserve.api.store.sqlite.check import diagnose, move_aside, prepare_store
from songserve.api.store.sqlite.connector import SqliteConnector
from songserve.api.store.sqlite.migrations import SCHEMA_VERSION
from songserve.api.store.sqlite.store import SqliteStore
from songserve.errors import ConfigError
from songserve.schemas import GenerateRequest
from tests.support.servers import ROOT, ServerProcess, free_port

STORE = "jobs.sqlite3"
INFO_LINE = re.compile(r"^\d{4}-\d\d-\d\d \S+ INFO ")


def _job(job_id: str, seq: int) -> Job:
    return Job(
        job_id=job_id,
        seq=seq,
        created_at=1.0,
        request=GenerateRequest(lyrics="x" * 500),
        cleaned_lyrics="x" * 500,
        tracks=[Track(job_id=job_id, index=i, seed=i) for i in range(2)],
    )


def _filled_store(state: Path, jobs: int = 60) -> Path:
    """A real store with enough rows to span several pages; closed, so the WAL is folded back in."""
    path = state / STORE
    store = SqliteStore(path)

    async def fill() -> None:
        for i in range(jobs):
            await store.insert_job(_job(f"{i:08x}aa", i + 1))
        await store.close()

    asyncio.run(fill())
    assert not path.with_name(STORE + "-wal").exists() or path.with_name(STORE + "-wal").stat().st_size == 0
    return path


def _migrate(path: Path, steps: tuple[Migration, ...]) -> list[int]:
    """Run the store's migration runner with ``steps`` on the file at ``path``."""
    conn = SqliteConnector(path)
    try:
        return asyncio.run(migrate(conn, steps))
    finally:
        conn.shutdown()


def _version(path: Path) -> int:
    """The file's schema version, read on a connection of its own."""
    db = sqlite3.connect(path)
    try:
        return migrations.user_version(db)
    finally:
        db.close()


def _garble_data_pages(path: Path) -> None:
    data = bytearray(path.read_bytes())
    page = int.from_bytes(data[16:18], "big")
    assert len(data) >= 4 * page
    for i in range(page, len(data)):  # page 1 (header, schema) intact; every later page garbage
        data[i] = (i * 7 + 13) % 256
    path.write_bytes(bytes(data))


def _dispatcher(state: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Start the real dispatcher on ``state`` and expect it to refuse: returns the finished process."""
    args = [sys.executable, "backend_api.py", "--port", str(free_port()), "--num-workers", "0"]
    args += ["--state-dir", str(state), *extra]
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)


def _one_line(out: subprocess.CompletedProcess) -> str:
    """The single line that is not a start-up INFO log line (settings echoed): the refusal."""
    lines = [ln for ln in out.stderr.splitlines() if ln.strip() and not INFO_LINE.match(ln)]
    assert len(lines) == 1, out.stderr
    assert "Traceback" not in out.stderr
    assert lines[0] == out.stderr.splitlines()[-1]
    return lines[0]


# -- real processes ---------------------------------------------------------------------------------


def test_garbage_in_data_pages_refuses_with_one_line(tmp_path: Path) -> None:
    path = _filled_store(tmp_path)
    _garble_data_pages(path)
    out = _dispatcher(tmp_path)
    assert out.returncode == 2, out.stderr
    line = _one_line(out)
    assert line.startswith(f"dispatcher: The job store {path} is damaged")
    assert "STORE_DAMAGED=move-aside" in line
    assert "Traceback" not in out.stderr
    assert path.exists()  # refused: nothing moved


def test_zero_byte_store_beside_results_refuses(tmp_path: Path) -> None:
    (tmp_path / "results" / "0123abcd").mkdir(parents=True)
    (tmp_path / STORE).write_bytes(b"")
    out = _dispatcher(tmp_path)
    assert out.returncode == 2
    line = _one_line(out)
    assert f"The job store {tmp_path / STORE} is empty (0 bytes) although results exist" in line


def test_non_sqlite_file_refuses(tmp_path: Path) -> None:
    (tmp_path / STORE).write_text("this is a note someone saved under the wrong name\n" * 20)
    out = _dispatcher(tmp_path)
    assert out.returncode == 2
    assert f"The job store {tmp_path / STORE} is not an SQLite database" in _one_line(out)


def test_newer_schema_refuses_even_with_move_aside(tmp_path: Path) -> None:
    path = _filled_store(tmp_path, jobs=1)
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    out = _dispatcher(tmp_path, "--store-damaged", "move-aside")
    assert out.returncode == 2
    line = _one_line(out)
    assert f"has schema version {SCHEMA_VERSION + 1}, newer than this build's {SCHEMA_VERSION}" in line
    assert str(path) in line
    assert list(tmp_path.glob("*.damaged-*")) == []


def test_move_aside_starts_a_fresh_store_and_says_so(tmp_path: Path) -> None:
    path = _filled_store(tmp_path)
    _garble_data_pages(path)
    port = free_port()
    api = ServerProcess(
        ["backend_api.py", "--port", str(port), "--num-workers", "0", "--state-dir", str(tmp_path)],
        port,
        tmp_path / "api.log",
        env={"STORE_DAMAGED": "move-aside"},
    )
    try:
        api.wait_healthy(want=("ok",), timeout=60)
        import httpx

        from tests.support.http import TLS

        assert httpx.get(api.url + "/status", timeout=5, verify=TLS).status_code == 200
        assert httpx.get(api.url + "/job/00000000aa", timeout=5, verify=TLS).status_code == 404
    finally:
        api.stop()
    moved = list(tmp_path.glob(f"{STORE}.damaged-*"))
    assert len([m for m in moved if not m.name.endswith(("-wal", "-shm"))]) == 1
    warnings = [ln for ln in api.log_path.read_text().splitlines() if "moved aside to" in ln]
    assert len(warnings) == 1
    assert str(path) in warnings[0]
    assert "is damaged" in warnings[0]
    assert diagnose(path) is None


# -- in process -------------------------------------------------------------------------------------


def test_missing_and_empty_without_results_are_new(tmp_path: Path) -> None:
    path = tmp_path / STORE
    assert prepare_store(path, "refuse", tmp_path / "results") is None
    SqliteStore(path).db.shutdown()
    assert _version(path) == SCHEMA_VERSION
    other = tmp_path / "b" / STORE
    other.parent.mkdir()
    other.write_bytes(b"")
    (other.parent / "results").mkdir()  # an empty results folder: nothing to orphan
    assert prepare_store(other, "refuse", other.parent / "results") is None
    assert other.stat().st_size > 0


def test_move_aside_keeps_wal_and_data(tmp_path: Path) -> None:
    path = _filled_store(tmp_path)
    _garble_data_pages(path)
    garbled = path.read_bytes()
    with pytest.raises(ConfigError, match="is damaged"):
        prepare_store(path, "refuse")
    moved = prepare_store(path, "move-aside")
    assert moved is not None
    assert moved.name.startswith(f"{STORE}.damaged-")
    assert moved.read_bytes() == garbled
    store = SqliteStore(path)
    assert asyncio.run(store.active_jobs()) == []
    store.db.shutdown()
    second = _filled_store(tmp_path / "again")
    _garble_data_pages(second)
    (tmp_path / "again" / f"{STORE}.damaged-x").write_bytes(b"")
    assert prepare_store(second, "move-aside") != moved


def test_move_aside_takes_the_side_files(tmp_path: Path) -> None:
    path = tmp_path / STORE
    path.write_bytes(b"main")
    path.with_name(STORE + "-wal").write_bytes(b"wal")
    path.with_name(STORE + "-shm").write_bytes(b"shm")
    moved = move_aside(path)
    assert not path.exists()
    assert not path.with_name(STORE + "-wal").exists()
    assert moved.read_bytes() == b"main"
    assert moved.with_name(moved.name + "-wal").read_bytes() == b"wal"
    assert moved.with_name(moved.name + "-shm").read_bytes() == b"shm"


def test_unversioned_store_is_migrated_with_its_rows(tmp_path: Path) -> None:
    """A store from before versioning (user_version 0, version 1's tables) comes forward intact."""
    path = tmp_path / STORE
    _migrate(path, migrations.MIGRATIONS[:1])
    db = sqlite3.connect(path, isolation_level=None)
    for i in range(3):
        db.execute(
            "INSERT INTO jobs (job_id, seq, created_at, request, cleaned_lyrics, num_tracks) VALUES (?, ?, 1, ?, 'x', 1)",
            (f"{i:08x}aa", i + 1, GenerateRequest(lyrics="x").model_dump_json()),
        )
        db.execute("INSERT INTO tracks (job_id, idx, status, seed) VALUES (?, 0, 'queued', 1)", (f"{i:08x}aa",))
    db.execute("PRAGMA user_version = 0")
    db.close()
    assert prepare_store(path) is None
    store = SqliteStore(path)
    assert _version(path) == SCHEMA_VERSION
    assert len(asyncio.run(store.active_jobs())) == 3
    store.db.shutdown()


def test_a_new_migration_applies_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _filled_store(tmp_path, jobs=2)
    step = Migration(SCHEMA_VERSION + 1, "track notes", ("ALTER TABLE tracks ADD COLUMN note TEXT",))
    extended = (*migrations.MIGRATIONS, step)
    assert _migrate(path, extended) == [SCHEMA_VERSION + 1]
    assert _migrate(path, extended) == []  # a second start applies nothing
    db = sqlite3.connect(path, isolation_level=None)
    cols = [r[1] for r in db.execute("PRAGMA table_info(tracks)")]
    assert "note" in cols
    assert migrations.user_version(db) == SCHEMA_VERSION + 1
    db.close()


def test_a_failing_migration_leaves_the_old_version(tmp_path: Path) -> None:
    path = _filled_store(tmp_path, jobs=1)
    bad = Migration(SCHEMA_VERSION + 1, "broken", ("ALTER TABLE tracks ADD COLUMN a TEXT", "NOT SQL AT ALL"))
    with pytest.raises(StoreError):
        _migrate(path, (*migrations.MIGRATIONS, bad))
    db = sqlite3.connect(path, isolation_level=None)
    assert migrations.user_version(db) == SCHEMA_VERSION
    assert "a" not in [r[1] for r in db.execute("PRAGMA table_info(tracks)")]
    db.close()


def test_jobstore_refuses_newer_schema(tmp_path: Path) -> None:
    path = _filled_store(tmp_path, jobs=1)
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 5}")
    db.close()
    with pytest.raises(ConfigError, match=f"{path}.*newer than this build"):
        SqliteStore(path)


def test_orphans_are_result_folders_without_a_job(tmp_path: Path) -> None:
    arts = ArtifactStore(tmp_path / "results")
    for name in ("aaaa1111", "bbbb2222", "cccc3333"):
        (arts.root / name).mkdir()
        (arts.root / name / "track_0.wav").write_bytes(b"RIFF")
    (arts.root / "not-a-job").mkdir()  # not ours: never reported, never removed
    (arts.root / "dddd4444").write_text("a file, not a folder")
    assert arts.orphans({"bbbb2222"}) == []  # all just written: their rows may be newer than the ids
    assert arts.orphans({"bbbb2222"}, min_age_sec=0) == ["aaaa1111", "cccc3333"]
    assert arts.orphans({"aaaa1111", "bbbb2222", "cccc3333"}, min_age_sec=0) == []
    store = SqliteStore(tmp_path / STORE)

    async def check() -> None:
        await store.insert_job(_job("aaaa1111", 1))
        assert arts.orphans(await store.job_ids(), min_age_sec=0) == ["bbbb2222", "cccc3333"]
        loaded = await store.load_job("aaaa1111")
        assert loaded is not None
        assert loaded.tracks[0].status is TrackStatus.queued

    asyncio.run(check())


def test_a_locked_store_is_refused_but_never_moved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process holding the store's lock is not damage: refuse, and touch nothing."""
    path = _filled_store(tmp_path, jobs=1)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("PRAGMA locking_mode=EXCLUSIVE")
    holder.execute("BEGIN EXCLUSIVE")
    real = sqlite3.connect
    monkeypatch.setattr(sqlite3, "connect", lambda *a, **kw: real(*a, **{**kw, "timeout": 0.1}))  # not 5 s
    try:
        with pytest.raises(ConfigError, match="cannot be checked .*locked.*nothing was changed"):
            prepare_store(path, "move-aside")
        assert path.exists()
        assert list(tmp_path.glob("*.damaged-*")) == []
    finally:
        holder.execute("ROLLBACK")
        holder.close()
