"""Tests of the integration tier (the tier: its conftest.py)."""
