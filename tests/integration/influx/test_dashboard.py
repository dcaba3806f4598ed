"""The InfluxDB history dashboard: every panel's and variable's Flux query runs on
the real influxd against history the agent wrote, and returns data. Grafana's
built-in time variables are supplied the way Grafana does (a `v` record)."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from tests.integration.influx.rig import T0, Clock, Rig
from tests.integration.influx.server import InfluxServer
from tests.support import REPO

pytestmark = pytest.mark.integration

DASHBOARD = REPO / "grafana" / "influxdb" / "gpudaemon-history.json"


def _rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _render(query: str, bucket: str, start: float, stop: float) -> str:
    """Grafana's interpolation: ${var} / ${var:regex} text, v.* as a Flux record."""
    q = query.replace("${bucket}", bucket)
    q = re.sub(r"\$\{(node|gpu)(:regex)?\}", ".*", q)
    assert "${" not in q, q
    v = (
        f"v = {{timeRangeStart: {_rfc3339(start)}, timeRangeStop: {_rfc3339(stop)}, "
        "windowPeriod: 20s}\n"
    )
    return v + q


def _queries(dash: dict[str, Any]) -> list[tuple[str, str]]:
    out = [(p["title"], t["query"]) for p in dash["panels"] for t in p["targets"]]
    out += [(v["name"], v["query"]) for v in dash["templating"]["list"] if v["type"] == "query"]
    return out


def test_dashboard_declares_the_influxdb_datasource_and_variables() -> None:
    dash = json.loads(DASHBOARD.read_text())
    names = [v["name"] for v in dash["templating"]["list"]]
    assert names == ["datasource", "bucket", "node", "gpu"]
    assert dash["templating"]["list"][0]["query"] == "influxdb"
    for p in dash["panels"]:
        assert p["datasource"] == {"type": "influxdb", "uid": "${datasource}"}, p["title"]


def test_every_dashboard_query_returns_data(
    influxd: InfluxServer, influx_db: str, tmp_path: Path
) -> None:
    rig = Rig(tmp_path, influxd.url, influx_db, Clock())
    for _ in range(8):
        rig.cycle()
    rig.close()
    dash = json.loads(DASHBOARD.read_text())
    empty = []
    for title, query in _queries(dash):
        flux = _render(query, f"{influx_db}/autogen", T0, T0 + 3600)
        if not influxd.query(flux):
            empty.append(title)
    assert not empty, f"queries without data: {empty}"
    gpus = influxd.query(
        _render(dict(_queries(dash))["gpu"], f"{influx_db}/autogen", T0, T0 + 3600)
    )
    assert sorted(int(r.value) for r in gpus) == list(range(8))
