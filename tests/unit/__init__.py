"""Tests of the unit tier (the tier: its conftest.py)."""
