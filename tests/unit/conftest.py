"""The unit tier: pure logic in the test process, no sockets and no servers (milliseconds a test)."""

import pytest

from tests.support.tiers import mark


def pytest_itemcollected(item: pytest.Item) -> None:
    mark(item, "unit")
