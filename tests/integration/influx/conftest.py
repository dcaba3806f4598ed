"""A real influxd 1.8.10 (built by scripts/test-tools) on 127.0.0.1 with a temporary
data directory, which tests can stop and start again to stage an outage.

It serves the v2 compatibility API: writes go to `/api/v2/write?bucket=db/rp`, Flux
queries to `/api/v2/query`. The token is `user:password` when auth is on and
ignored when it is off.
"""

from __future__ import annotations

import io
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from loguru import logger

from tests.integration.influx.server import ADMIN, InfluxServer


def _server(tools_bin: Path, tmp: Path, auth: bool) -> Iterator[InfluxServer]:
    binary = tools_bin / "influxd"
    if not binary.exists():
        pytest.fail(f"{binary} is missing: run scripts/test-tools influxd")
    server = InfluxServer(binary, tmp, auth=auth)
    if auth:
        server.env["INFLUXDB_HTTP_AUTH_ENABLED"] = "false"
        server.start()  # first admin user; then restart with auth on
        server.influxql(f"CREATE USER {ADMIN[0]} WITH PASSWORD '{ADMIN[1]}' WITH ALL PRIVILEGES")
        server.stop()
        server.env["INFLUXDB_HTTP_AUTH_ENABLED"] = "true"
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def influxd(tools_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InfluxServer]:
    """influxd without auth, shared by the session; tests use their own database."""
    yield from _server(tools_bin, tmp_path_factory.mktemp("influxd"), auth=False)


@pytest.fixture(scope="session")
def influxd_auth(
    tools_bin: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[InfluxServer]:
    """influxd with auth on: a wrong token gets a real 401."""
    yield from _server(tools_bin, tmp_path_factory.mktemp("influxd-auth"), auth=True)


@pytest.fixture
def influx_db(influxd: InfluxServer) -> Iterator[str]:
    """A fresh database; the server is running again afterwards even if a test that
    staged an outage failed half-way."""
    if not influxd.running:
        influxd.start()
    yield influxd.create_database(f"h_{uuid.uuid4().hex[:10]}")
    if not influxd.running:
        influxd.start()


@pytest.fixture
def logs() -> Iterator[io.StringIO]:
    """Every log line (TRACE and up) of the test, as "LEVEL message"."""
    buf = io.StringIO()
    sink = logger.add(buf, level="TRACE", format="{level} {message}")
    yield buf
    logger.remove(sink)
