"""A real influxd 1.8.10 (built by scripts/test-tools) on 127.0.0.1 with a temporary
data directory, which a test or a benchmark can stop and start again to stage an outage.

It serves the v2 compatibility API: writes go to `/api/v2/write?bucket=db/rp`, Flux
queries to `/api/v2/query`. The token is `user:password` when auth is on and
ignored when it is off. Shared by tests/integration/influx (through its conftest) and
bench/influx.
"""

from __future__ import annotations

import os
import signal
import subprocess
import urllib.parse
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from influxdb_client.client.influxdb_client import InfluxDBClient

from tests.support import ProcessExited, free_port, wait_for

ADMIN = ("admin", "admin-password")


@dataclass(frozen=True)
class Row:
    time: datetime | None
    field: str | None
    value: Any
    tags: dict[str, str]


class InfluxServer:
    def __init__(self, binary: Path, workdir: Path, auth: bool = False) -> None:
        self.binary = binary
        self.workdir = workdir
        self.auth = auth
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = workdir / "influxd.log"
        self.config = workdir / "influxdb.conf"
        self.config.write_text("")  # defaults; the environment below overrides them
        self.env = {
            **os.environ,
            "INFLUXDB_HTTP_BIND_ADDRESS": f"127.0.0.1:{self.port}",
            # The RPC (backup) service would take :8088, shared by every influxd here.
            "INFLUXDB_BIND_ADDRESS": f"127.0.0.1:{free_port()}",
            "INFLUXDB_HTTP_FLUX_ENABLED": "true",
            "INFLUXDB_HTTP_AUTH_ENABLED": "true" if auth else "false",
            "INFLUXDB_HTTP_LOG_ENABLED": "false",
            "INFLUXDB_REPORTING_DISABLED": "true",
            "INFLUXDB_MONITOR_STORE_ENABLED": "false",
            "INFLUXDB_DATA_QUERY_LOG_ENABLED": "false",
            "INFLUXDB_META_DIR": str(workdir / "meta"),
            "INFLUXDB_DATA_DIR": str(workdir / "data"),
            "INFLUXDB_DATA_WAL_DIR": str(workdir / "wal"),
        }

    # -- lifecycle ---------------------------------------------------------------

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, "influxd already running"
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [str(self.binary), "run", "-config", str(self.config)],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        wait_for(self._ping, timeout=90, what=f"influxd on {self.url} (log: {self.log})")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _ping(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise ProcessExited(f"influxd exited {self.proc.returncode}: see {self.log}")
        with urllib.request.urlopen(f"{self.url}/ping", timeout=2) as r:
            return bool(r.status == 204)

    # -- the 1.x API, for setup ---------------------------------------------------

    def influxql(self, q: str, user: tuple[str, str] | None = None) -> bytes:
        # influxd reads u/p from the URL only, q also from the form body.
        creds = "?" + urllib.parse.urlencode({"u": user[0], "p": user[1]}) if user else ""
        req = urllib.request.Request(
            f"{self.url}/query{creds}", data=urllib.parse.urlencode({"q": q}).encode()
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            body: bytes = r.read()
        assert b'"error"' not in body, body
        return body

    def create_database(self, name: str) -> str:
        self.influxql(f'CREATE DATABASE "{name}"', ADMIN if self.auth else None)
        return name

    # -- Flux through the v2 compatibility API ------------------------------------

    @property
    def token(self) -> str:
        return ":".join(ADMIN) if self.auth else "unused"

    def query(self, flux: str) -> list[Row]:
        with InfluxDBClient(url=self.url, token=self.token, org="-", timeout=20_000) as c:
            tables = c.query_api().query(flux, org="-")
        rows = []
        for t in tables:
            for r in t.records:
                v = r.values
                tags = {k: v[k] for k in ("node", "gpu", "uuid", "model") if k in v}
                rows.append(Row(v.get("_time"), v.get("_field"), v.get("_value"), tags))
        return rows

    def points(self, db: str, field: str | None = None) -> list[Row]:
        """Every stored `gpu` point (one row per field), oldest first."""
        flt = f' and r._field == "{field}"' if field else ""
        return self.query(
            f'from(bucket: "{db}/autogen") |> range(start: 2000-01-01T00:00:00Z)'
            f' |> filter(fn: (r) => r._measurement == "gpu"{flt})'
        )
