"""A throw-away PostgreSQL server for tests and benchmarks: ``initdb`` into a temporary folder, ``pg_ctl start``
on a free port, stopped and removed at the end.

Why a real server rather than a mock: the PostgreSQL job store relies on row locks with ``SKIP LOCKED``,
``LISTEN/NOTIFY`` and advisory locks, whose behaviour across connections is the thing under test. The server
is tuned for throw-away data (``fsync=off``, no full-page writes), which changes durability only, not locking.

Debian installs the binaries under ``/usr/lib/postgresql/<version>/bin`` without putting them on PATH;
``initdb`` refuses to run as root, so under root the server runs as the ``postgres`` system user (which
Debian's package creates) and its folder is owned by that user.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import pwd
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support.servers import free_port

log = logging.getLogger(__name__)

SUPERUSER = "postgres"
SETTINGS = {
    "listen_addresses": "'127.0.0.1'",
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    # Several dispatchers, each with a connection pool, plus the tests' own connections.
    "max_connections": "200",
    "shared_buffers": "64MB",
    "log_min_messages": "warning",
    "log_min_error_statement": "panic",
}


def find_bin_dir() -> Path | None:
    """The folder holding ``initdb``, ``pg_ctl`` and ``postgres``: ``PG_BIN``, then PATH, then Debian's
    ``/usr/lib/postgresql/*/bin`` (newest version first)."""
    candidates: list[Path] = []
    if os.environ.get("PG_BIN"):
        candidates.append(Path(os.environ["PG_BIN"]))
    on_path = shutil.which("initdb")
    if on_path:
        candidates.append(Path(on_path).resolve().parent)
    debian = Path("/usr/lib/postgresql").glob("*/bin")
    candidates += sorted(debian, key=lambda p: [int(x) for x in re.findall(r"\d+", p.parent.name)], reverse=True)
    for folder in candidates:
        if all((folder / name).is_file() and os.access(folder / name, os.X_OK) for name in ("initdb", "pg_ctl")):
            return folder
    return None


def unavailable() -> str | None:
    """Why no server can be started here (a one-line reason naming what is missing), or None."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "the Python package psycopg is not installed (pip install 'psycopg[binary]')"
    if find_bin_dir() is None:
        return (
            "PostgreSQL's initdb/pg_ctl not found on PATH, in $PG_BIN or under /usr/lib/postgresql/*/bin "
            "(Debian: apt-get install postgresql; scripts/test does this)"
        )
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(SUPERUSER)
        except KeyError:
            return f"running as root and there is no '{SUPERUSER}' system user to run PostgreSQL as"
    return None


class PgServer:
    """One running server; ``url(db)`` gives a TCP URL any process can use, ``create_database`` a fresh one."""

    def __init__(self, bin_dir: Path, root: Path, port: int) -> None:
        self.bin_dir = bin_dir
        self.root = root
        self.data = root / "data"
        self.socket_dir = root
        self.port = port
        self._names = itertools.count(1)
        self._run_as: pwd.struct_passwd | None = pwd.getpwnam(SUPERUSER) if os.geteuid() == 0 else None
        self.running = False

    def _run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """A PostgreSQL program, as the ``postgres`` user when we are root; raises with its output on failure."""
        kwargs: dict = {}
        env = {**os.environ, "LC_ALL": "C"}
        if self._run_as is not None:
            kwargs = {"user": self._run_as.pw_uid, "group": self._run_as.pw_gid, "extra_groups": []}
            env.update(HOME=self._run_as.pw_dir, USER=SUPERUSER, LOGNAME=SUPERUSER)
        out = subprocess.run(
            [str(self.bin_dir / args[0]), *args[1:]],
            cwd=self.root,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            **kwargs,
        )
        if out.returncode != 0:
            raise RuntimeError(f"{args[0]} failed ({out.returncode}): {(out.stderr or out.stdout).strip()[-2000:]}")
        return out

    def start(self) -> PgServer:
        if self._run_as is not None:
            os.chown(self.root, self._run_as.pw_uid, self._run_as.pw_gid)
        self._run("initdb", "-D", str(self.data), "-U", SUPERUSER, "--auth=trust", "--no-locale", "-E", "UTF8", "-N")
        conf = {**SETTINGS, "port": str(self.port), "unix_socket_directories": f"'{self.socket_dir}'"}
        with open(self.data / "postgresql.conf", "a") as f:
            f.write("\n# tests/support/pg.py: a throw-away server\n")
            f.writelines(f"{k} = {v}\n" for k, v in conf.items())
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "server.log"), "-w", "-t", "60", "start")
        self.running = True
        log.info("PostgreSQL started on port %d in %s", self.port, self.root)
        return self

    def pause(self) -> None:
        """Stop the server as a crash would (``immediate``), keeping its data: a database outage.

        What was committed is flushed first: with ``synchronous_commit=off`` (the throw-away tuning) a
        crash may lose the last fraction of a second of commits, which a production server would keep."""
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute("CHECKPOINT")
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop", timeout=60)
        self.running = False

    def resume(self) -> None:
        """Start it again on the same port and data after ``pause``."""
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "server.log"), "-w", "-t", "60", "start")
        self.running = True

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{dbname}"

    def create_database(self) -> str:
        """A fresh, empty database ``t_<n>``; its name."""
        import psycopg

        name = f"t_{next(self._names)}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return name

    def drop_database(self, name: str) -> None:
        """Drops it even while processes a test left behind are still connected (FORCE ends their sessions)."""
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    def log_tail(self, n: int = 4000) -> str:
        path = self.root / "server.log"
        return path.read_text(errors="replace")[-n:] if path.exists() else ""

    def stop(self) -> None:
        """Immediate stop (no checkpoint: the data is thrown away) and the folder removed."""
        if self.running:
            self.running = False
            try:
                self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop", timeout=60)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                log.warning("PostgreSQL in %s did not stop cleanly: %s", self.root, exc)
        shutil.rmtree(self.root, ignore_errors=True)


def start_server() -> PgServer:
    """Start a server in a new temporary folder (not pytest's tmp_path: its parents are closed to other users,
    and under root the server runs as ``postgres``). Raises RuntimeError if ``unavailable()`` says why not."""
    why = unavailable()
    if why:
        raise RuntimeError(why)
    bin_dir = find_bin_dir()
    assert bin_dir is not None
    root = Path(tempfile.mkdtemp(prefix="songserve-pg-"))
    server = PgServer(bin_dir, root, free_port())
    atexit.register(server.stop)  # a backstop if the caller dies before its own stop
    try:
        return server.start()
    except BaseException:
        tail = server.log_tail()
        server.stop()
        if tail:
            raise RuntimeError(f"PostgreSQL did not start; its log:\n{tail}") from None
        raise


@contextmanager
def server() -> Iterator[PgServer]:
    """``with server() as pg:`` a running server for the block (benchmarks use this)."""
    s = start_server()
    try:
        yield s
    finally:
        s.stop()
