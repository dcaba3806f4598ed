"""Fixtures shared by the unit tests (the log capture `lines` is in tests/conftest.py)."""
