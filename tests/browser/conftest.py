"""The browser tier: pages in headless Chromium (Debian's package, driven by Playwright)."""

import pytest

from tests.support.tiers import mark


def pytest_itemcollected(item: pytest.Item) -> None:
    mark(item, "browser")
