"""Fixtures for the pod-resources tests: a short temp dir and a fake kubelet in it."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.podresources.fake_kubelet import KubeletServer


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    # Unix socket paths are limited to 107 bytes; pytest's tmp_path can be longer.
    d = Path(tempfile.mkdtemp(prefix="gpud-kl-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def kubelet(short_tmp: Path) -> Iterator[KubeletServer]:
    server = KubeletServer(short_tmp / "kubelet.sock")
    yield server
    server.stop()
