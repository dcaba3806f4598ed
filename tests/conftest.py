"""Fixtures shared by every test area. Area-specific fixtures (control plane,
Prometheus, InfluxDB) live in the conftest.py of their folder."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from loguru import logger

from tests.support import ToolsError
from tests.support import tools_bin as find_tools


@pytest.fixture(scope="session", name="tools_bin")
def tools_bin_fixture() -> Path:
    """The real test servers (tests/support.py:tools_bin, which bench/ uses too). Never
    skips: an integration test without its server is a failure, not a pass."""
    try:
        return find_tools()
    except ToolsError as e:
        pytest.fail(str(e))


@pytest.fixture
def lines() -> Iterator[list[tuple[str, str]]]:
    """(level, message) of every loguru line logged during the test."""
    out: list[tuple[str, str]] = []
    sink = logger.add(lambda m: out.append((m.record["level"].name, m.record["message"])))
    try:
        yield out
    finally:
        logger.remove(sink)
