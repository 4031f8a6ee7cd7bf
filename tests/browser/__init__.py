"""Tests of the browser tier (the tier: its conftest.py)."""
