"""Tests of the process tier (the tier: its conftest.py)."""
