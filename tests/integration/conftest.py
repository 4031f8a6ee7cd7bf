"""The integration tier: servers in threads of the test process (or a throw-away PostgreSQL), real
sockets, real HTTP through httpx; no process of our own started but a command-line client."""

import pytest

from tests.support.tiers import mark


def pytest_itemcollected(item: pytest.Item) -> None:
    mark(item, "integration")
