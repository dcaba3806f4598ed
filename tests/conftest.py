"""Fixtures shared by every test area. Area-specific fixtures (control plane,
Prometheus, InfluxDB) live in the conftest.py of their folder."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.support import REPO


@pytest.fixture(scope="session")
def tools_bin() -> Path:
    """The directory holding the real test servers built by scripts/test-tools.

    Uses $GPUDAEMON_TOOLS_BIN when the test command already ran the script; otherwise
    runs it (a no-op when everything is built). Never skips: an integration test
    without its server is a failure, not a pass.
    """
    env = os.environ.get("GPUDAEMON_TOOLS_BIN")
    if env:
        return Path(env)
    proc = subprocess.run([str(REPO / "scripts" / "test-tools")], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail(f"scripts/test-tools failed:\n{proc.stderr[-2000:]}")
    path = Path(proc.stdout.strip().splitlines()[-1])
    os.environ["GPUDAEMON_TOOLS_BIN"] = str(path)
    return path
