"""The integration tier: servers in threads of the test process (or a throw-away PostgreSQL), real
sockets, real HTTP through httpx; no process of our own started but a command-line client."""

from pathlib import Path

import pytest

from tests.support.tiers import mark


def pytest_itemcollected(item: pytest.Item) -> None:
    mark(item, "integration")


@pytest.fixture(params=["sqlite", "postgresql"])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The store location for the engine: a file, or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return str(tmp_path / "jobs.sqlite3")
    return str(request.getfixturevalue("pg_url"))
