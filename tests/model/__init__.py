"""Tests of the model tier (the tier: its conftest.py)."""
