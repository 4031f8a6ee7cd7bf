"""The tiers' markers, applied by each tier folder's ``conftest.py`` to the tests collected there.

A test's tier is its folder: ``unit``, ``integration``, ``process``, ``model``, ``browser`` (what each
holds: ``tests/support/__init__.py``). ``quick`` is the edit-test loop (``bash scripts/test -m quick``):
the unit and integration tiers, but for a test marked ``process`` there, plus any test marked
``quick`` by hand in a slower tier (the in-process tests of a file whose point is a real process).
"""

from __future__ import annotations

import pytest

QUICK_TIERS = ("unit", "integration")


def mark(item: pytest.Item, tier: str) -> None:
    """Give ``item`` its tier's marker, and ``quick`` where its tier is part of the edit-test loop."""
    item.add_marker(tier)
    if tier in QUICK_TIERS and item.get_closest_marker("process") is None:
        item.add_marker("quick")
