"""The model tier: the tiny checkpoint set through the pipeline, the engine and a real model worker, and
the loaders of the release's own files."""

import pytest

from tests.support.tiers import mark


def pytest_itemcollected(item: pytest.Item) -> None:
    mark(item, "model")
