"""Fixtures shared by the unit tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from loguru import logger


@pytest.fixture
def lines() -> Iterator[list[tuple[str, str]]]:
    """(level, message) of every loguru line logged during the test."""
    out: list[tuple[str, str]] = []
    sink = logger.add(lambda m: out.append((m.record["level"].name, m.record["message"])))
    try:
        yield out
    finally:
        logger.remove(sink)
