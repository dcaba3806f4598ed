"""End to end: real `gpudaemon run` processes (simulated dgx-h100, 1 s schedules)
against a real influxd. Done-criterion 3 (an outage with an agent restart in the
middle loses nothing) and 5 (a wrong token or unreachable URL is logged, counted and
survived), including SIGTERM handling and `promtool check metrics` on the history
metrics."""

from __future__ import annotations

import re
import sqlite3
import subprocess
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from tests.integration.influx.rig import GPM_FIELDS
from tests.integration.influx.server import InfluxServer
from tests.support import free_port, http_get, scrape, start_agent, stop, wait_for

pytestmark = pytest.mark.integration


class AgentProcess:
    def __init__(self, tmp: Path, name: str, influx: dict[str, object], env: dict[str, str]):
        self.port = free_port()
        self.log = tmp / f"{name}.log"
        cfg = tmp / f"{name}.yaml"
        cfg.write_text(
            yaml.safe_dump(
                {
                    "node_name": "node-e2e",
                    "simulate": "dgx-h100",
                    "schedules": {
                        "telemetry": "* * * * * *",
                        "history": "* * * * * *",
                        "inventory": "0 */5 * * * *",
                        "labels": "*/30 * * * * *",
                    },
                    "labels": {"to": str(tmp / "labels.json")},
                    "metrics": {"listen": f"127.0.0.1:{self.port}"},
                    # below the 1 s history period, as config validation requires
                    "influxdb": {"timeout_ms": 800, "shutdown_flush_seconds": 5, **influx},
                }
            )
        )
        self.proc: subprocess.Popen[bytes] = start_agent(
            ["run", "--config", str(cfg)], env=env, log=self.log
        )
        wait_for(self._healthy, timeout=30, what=f"{name} /healthz (log: {self.log})")

    def _healthy(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text()
        return http_get(f"http://127.0.0.1:{self.port}/healthz", timeout=2)[0] == 200

    def metric(self, name: str, **labels: str) -> float:
        return scrape(f"http://127.0.0.1:{self.port}/metrics", name, required=True, **labels)

    def wait_metric(
        self, name: str, pred: Callable[[float], bool], timeout: float = 30, **labels: str
    ) -> None:
        wait_for(
            lambda: pred(self.metric(name, **labels)),
            timeout=timeout,
            what=f"{name}{labels} (log: {self.log})",
        )

    def sigterm(self) -> str:
        code = stop(self.proc, timeout=20)
        assert code == 0, f"exit code {code}: {self.log.read_text()[-3000:]}"
        return self.log.read_text()


def spooled_points(spool: Path) -> set[tuple[str, int]]:
    """(gpu, timestamp ms) of every point in the spool of a stopped agent."""
    out = set()
    con = sqlite3.connect(f"file:{spool / 'spool.db'}?mode=ro", uri=True)
    try:
        for (line,) in con.execute("SELECT line FROM points ORDER BY id"):
            text = bytes(line).decode()
            gpu = re.search(r",gpu=(\d+)", text)
            assert gpu, text
            out.add((gpu.group(1), int(text.rsplit(" ", 1)[1])))
    finally:
        con.close()
    return out


def test_outage_with_restarts_of_the_agent_process_loses_nothing(
    influxd: InfluxServer, influx_db: str, tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    influx = {"url": influxd.url, "bucket": f"{influx_db}/autogen", "spool_dir": str(spool)}
    env = {"GPUDAEMON_INFLUXDB__TOKEN": "unused"}

    first = AgentProcess(tmp_path, "first", influx, env)
    first.wait_metric("gpudaemon_influxdb_points_written_total", lambda v: v >= 16)
    influxd.stop()
    first.wait_metric("gpudaemon_influxdb_points_spooled", lambda v: v >= 24)
    log_first = first.sigterm()
    from_first = spooled_points(spool)
    assert len(from_first) >= 24
    assert "points in the InfluxDB spool" in log_first  # told why it left them

    second = AgentProcess(tmp_path, "second", influx, env)
    second.wait_metric("gpudaemon_influxdb_points_spooled", lambda v: v >= len(from_first) + 16)
    log_second = second.sigterm()  # still in the outage
    assert "from an earlier run" in log_second
    from_second = spooled_points(spool) - from_first
    assert from_second
    assert from_first <= spooled_points(spool)  # nothing of the first run lost

    influxd.start()
    third = AgentProcess(tmp_path, "third", influx, env)
    third.wait_metric("gpudaemon_influxdb_points_spooled", lambda v: v == 0)
    third.sigterm()
    assert spooled_points(spool) == set()

    rows = influxd.points(influx_db)
    stored: dict[tuple[str, str], list[int]] = defaultdict(list)
    for r in rows:
        stored[(r.tags["gpu"], r.field)].append(round(r.time.timestamp() * 1000))
    power = {(g, t) for (g, f), ts in stored.items() if f == "power_watts" for t in ts}
    lost = (from_first | from_second) - power
    assert not lost, f"{len(lost)} spooled points never reached InfluxDB"
    # Every field of a GPU has the same points: nothing half-written, no duplicates.
    for (gpu, field), ts in stored.items():
        assert ts == sorted(set(ts))
        power_ts = stored[(gpu, "power_watts")]
        if field in GPM_FIELDS:  # each process's first poll has no GPM pair: 3 processes
            assert set(ts) <= set(power_ts) and len(ts) >= len(power_ts) - 3
        else:
            assert len(ts) == len(power_ts)
    assert {g for g, _ in stored} == {str(i) for i in range(8)}


def test_wrong_token_is_logged_counted_and_survived(
    influxd_auth: InfluxServer, tmp_path: Path
) -> None:
    db = influxd_auth.create_database("e2e_auth")
    secret = "admin:wrong-secret-4711"
    agent = AgentProcess(
        tmp_path,
        "wrong-token",
        {"url": influxd_auth.url, "bucket": f"{db}/autogen", "spool_dir": str(tmp_path / "s")},
        {"GPUDAEMON_INFLUXDB__TOKEN": secret},
    )
    agent.wait_metric(
        "gpudaemon_influxdb_write_errors_total", lambda v: v >= 3, kind="unauthorized"
    )
    assert agent.metric("gpudaemon_influxdb_points_spooled") >= 16
    assert http_get(f"http://127.0.0.1:{agent.port}/healthz")[0] == 200
    log = agent.sigterm()
    # One clear line for the failure, not one per cycle. (On a loaded machine a
    # request may also time out now and then: that is another kind, with its own line.)
    failures = [line for line in log.splitlines() if "failed (unauthorized)" in line]
    assert len(failures) == 1 and "HTTP 401" in failures[0]
    assert "wrong-secret-4711" not in log
    assert "Traceback" not in log


def test_unreachable_url_is_logged_counted_and_survived(tmp_path: Path, tools_bin: Path) -> None:
    agent = AgentProcess(
        tmp_path,
        "unreachable",
        {
            "url": f"http://127.0.0.1:{free_port()}",
            "bucket": "db/autogen",
            "spool_dir": str(tmp_path / "s"),
        },
        {},
    )
    agent.wait_metric("gpudaemon_influxdb_write_errors_total", lambda v: v >= 2, kind="unreachable")
    assert http_get(f"http://127.0.0.1:{agent.port}/readyz")[0] == 200
    # The history metrics follow the naming rules too.
    body = http_get(f"http://127.0.0.1:{agent.port}/metrics")[1]
    assert b"gpudaemon_influxdb_points_spooled" in body
    lint = subprocess.run(
        [str(tools_bin / "promtool"), "check", "metrics"], input=body, capture_output=True
    )
    assert (lint.returncode, lint.stdout, lint.stderr) == (0, b"", b"")
    log = agent.sigterm()
    assert "(unreachable)" in log
    assert "Traceback" not in log
