"""The process tier: real processes (forked from a template or fresh), signals and kill -9, full disks,
the launcher (run in order in one unit: tests/support/schedule.py), load and memory measured."""

import pytest

from tests.support.tiers import mark


def pytest_itemcollected(item: pytest.Item) -> None:
    mark(item, "process")
