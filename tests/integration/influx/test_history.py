"""Done-criteria 1, 2, 4 and 5 of issue 5 against a real influxd, driven in-process:
an Agent on simulated dgx-h100 GPUs with an injected clock, so every cycle's sample
time (and therefore every expected point) is known exactly. The end-to-end runs of
`gpudaemon run` are in test_agent_process.py."""

from __future__ import annotations

import io
import socket
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from tests.integration.influx.rig import ALWAYS, GPM_FIELDS, Clock, Rig
from tests.integration.influx.server import InfluxServer

pytestmark = pytest.mark.integration


def ms(t: float) -> int:
    return round(t * 1000)


def by_series(rows: list) -> dict[tuple[str, str], list[int]]:  # type: ignore[type-arg]
    """(gpu, field) -> stored timestamps in ms, oldest first."""
    out: dict[tuple[str, str], list[int]] = defaultdict(list)
    for r in rows:
        out[(r.tags["gpu"], r.field)].append(round(r.time.timestamp() * 1000))
    return out


def assert_exactly(rows: list, *runs: list[float]) -> None:  # type: ignore[type-arg]
    """Every field of every GPU holds exactly one point per expected time (each run's
    times; GPM's fields lack a run's first poll: they need two samples)."""
    series = by_series(rows)
    want = sorted(ms(t) for times in runs for t in times)
    want_gpm = sorted(ms(t) for times in runs for t in times[1:])
    assert {g for g, _ in series} == {str(i) for i in range(8)}
    for (gpu, field), stamps in series.items():
        assert stamps == (want_gpm if field in GPM_FIELDS else want), f"gpu {gpu} field {field}"
    for gpu in range(8):
        assert {f for g, f in series if g == str(gpu)} >= ALWAYS


def test_n_cycles_give_n_times_8_points_per_field_with_the_right_tags(
    influxd: InfluxServer, influx_db: str, tmp_path: Path
) -> None:
    rig = Rig(tmp_path, influxd.url, influx_db, Clock())
    n = 6
    for _ in range(n):
        rig.cycle()
    rig.close()

    rows = influxd.points(influx_db)
    per_field = Counter(r.field for r in rows)
    assert set(per_field) >= ALWAYS
    assert all(c == (n - 1 if f in GPM_FIELDS else n) * 8 for f, c in per_field.items()), per_field
    assert_exactly(rows, rig.times)

    inv = rig.agent.cache.get().inventory
    assert inv is not None
    want_tags = {(str(g.index), g.uuid, g.name, "node-it") for g in inv.gpus}
    got_tags = {(r.tags["gpu"], r.tags["uuid"], r.tags["model"], r.tags["node"]) for r in rows}
    assert got_tags == want_tags
    assert rig.metric("gpudaemon_influxdb_points_written_total") == n * 8
    # Same units as the metrics: bytes are bytes, ratios 0-1.
    mem = [r.value for r in rows if r.field == "memory_total_bytes"]
    assert len(mem) == n * 8 and all(v == inv.gpus[0].memory_total_bytes for v in mem)
    util = [r.value for r in rows if r.field == "utilization_ratio"]
    assert len(util) == n * 8 and all(0.0 <= v <= 1.0 for v in util)


def test_outage_points_are_replayed_in_order_without_duplicates(
    influxd: InfluxServer, influx_db: str, tmp_path: Path, logs: io.StringIO
) -> None:
    rig = Rig(tmp_path, influxd.url, influx_db, Clock())
    for _ in range(3):
        rig.cycle()
    influxd.stop()
    for _ in range(5):
        rig.cycle()
    assert rig.metric("gpudaemon_influxdb_points_spooled") == 5 * 8
    assert rig.metric("gpudaemon_influxdb_write_errors_total", kind="unreachable") >= 1
    assert "InfluxDB write to" in logs.getvalue() and "(unreachable)" in logs.getvalue()
    influxd.start()
    for _ in range(2):
        rig.cycle()
    assert rig.metric("gpudaemon_influxdb_points_spooled") == 0
    rig.close()

    assert_exactly(influxd.points(influx_db), rig.times)
    assert rig.recording.accepted == sorted(rig.recording.accepted)  # oldest first
    assert len(rig.recording.accepted) == 10 * 8  # each point sent once
    assert rig.metric("gpudaemon_influxdb_points_dropped_total", reason="overflow") == 0


def test_outage_with_an_agent_restart_in_the_middle_loses_nothing(
    influxd: InfluxServer, influx_db: str, tmp_path: Path
) -> None:
    clock = Clock()
    first = Rig(tmp_path, influxd.url, influx_db, clock)
    for _ in range(2):
        first.cycle()
    influxd.stop()
    for _ in range(3):
        first.cycle()
    first.close()  # SIGTERM path: flush fails, the rest stays on disk

    second = Rig(tmp_path, influxd.url, influx_db, clock)
    assert second.metric("gpudaemon_influxdb_points_spooled") == 3 * 8
    for _ in range(3):
        second.cycle()
    influxd.start()
    second.cycle()
    second.close()

    assert_exactly(influxd.points(influx_db), first.times, second.times)
    assert second.recording.accepted == sorted(second.recording.accepted)


def test_spool_smaller_than_the_outage_drops_the_oldest_and_counts_them(
    influxd: InfluxServer, influx_db: str, tmp_path: Path, logs: io.StringIO
) -> None:
    rig = Rig(tmp_path, influxd.url, influx_db, Clock(), spool_max_bytes=100_000)
    rig.cycle()
    influxd.stop()
    for _ in range(40):
        rig.cycle()
    dropped = rig.metric("gpudaemon_influxdb_points_dropped_total", reason="overflow")
    assert dropped > 0
    spool = rig.writer.spool
    assert spool.size_bytes + spool.wal_bytes <= 100_000
    assert sum(p.stat().st_size for p in (tmp_path / "spool").iterdir()) <= 100_000
    assert "dropped the" in logs.getvalue() and "oldest points" in logs.getvalue()
    assert rig.agent.readiness()[0]  # the process stays healthy
    influxd.start()
    rig.cycle()
    rig.close()

    rows = influxd.points(influx_db, field="power_watts")
    stored = sorted({round(r.time.timestamp() * 1000) for r in rows})
    expected = [ms(t) for t in rig.times]
    missing = [t for t in expected if t not in stored]
    assert len(rows) == len(stored) * 8 - 0  # no duplicates: one row per GPU per time
    assert len(missing) * 8 == dropped  # the counter says exactly what is missing
    outage = expected[1:-1]
    assert missing == outage[: len(missing)]  # and it is the oldest of the outage
    assert stored[0] == expected[0] and stored[-1] == expected[-1]


def test_unreachable_url_is_logged_counted_and_bounded(tmp_path: Path, logs: io.StringIO) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(4)  # accepts connections, never answers: the worst kind of outage
        port = s.getsockname()[1]
        rig = Rig(tmp_path, f"http://127.0.0.1:{port}", "db", Clock(), timeout_ms=500)
        rig.cycle()  # one timeout_ms, not a hang (the cost is in bench/influx)
        assert rig.metric("gpudaemon_influxdb_write_errors_total", kind="timeout") == 1
    rig.cycle()  # the socket is closed: nothing listens on the port now
    assert rig.metric("gpudaemon_influxdb_write_errors_total", kind="unreachable") == 1
    assert rig.metric("gpudaemon_influxdb_points_spooled") == 16
    assert rig.agent.readiness()[0]
    text = logs.getvalue()
    assert "(timeout)" in text and "(unreachable)" in text
    rig.close()


def test_wrong_token_is_unauthorized_and_the_right_one_works(
    influxd_auth: InfluxServer, tmp_path: Path, logs: io.StringIO
) -> None:
    db = influxd_auth.create_database("authdb")
    wrong = Rig(tmp_path / "a", influxd_auth.url, db, Clock(), token="admin:not-the-password")
    wrong.cycle()
    assert wrong.metric("gpudaemon_influxdb_write_errors_total", kind="unauthorized") == 1
    assert wrong.metric("gpudaemon_influxdb_points_spooled") == 8
    text = logs.getvalue()
    assert "(unauthorized)" in text and "HTTP 401" in text
    assert "not-the-password" not in text
    wrong.close()

    right = Rig(tmp_path / "b", influxd_auth.url, db, Clock(), token="admin:admin-password")
    right.cycle()
    right.close()
    assert right.metric("gpudaemon_influxdb_write_errors_total", kind="unauthorized") == 0
    assert len(influxd_auth.points(db, field="power_watts")) == 8


def test_credentials_in_the_url_are_sent_as_basic_auth(
    influxd_auth: InfluxServer, tmp_path: Path, logs: io.StringIO
) -> None:
    """http://user:password@host works as curl reads it (no token needed), and a wrong
    password in the URL is a real 401 whose password reaches no log line."""
    db = influxd_auth.create_database("urlauth")
    host = influxd_auth.url.removeprefix("http://")
    wrong = Rig(tmp_path / "a", f"http://admin:wrong-pw-4711@{host}", db, Clock())
    wrong.cycle()
    assert wrong.metric("gpudaemon_influxdb_write_errors_total", kind="unauthorized") == 1
    wrong.close()
    assert "wrong-pw-4711" not in logs.getvalue()

    # A password with URL-escaped characters is unescaped before it is sent.
    influxd_auth.influxql("CREATE USER \"we b\" WITH PASSWORD 'p@ss:w/rd' WITH ALL PRIVILEGES",
                          ("admin", "admin-password"))  # fmt: skip
    right = Rig(tmp_path / "b", f"http://we%20b:p%40ss%3Aw%2Frd@{host}", db, Clock())
    right.cycle()
    right.close()
    assert right.metric("gpudaemon_influxdb_write_errors_total", kind="unauthorized") == 0
    assert len(influxd_auth.points(db, field="power_watts")) == 8
