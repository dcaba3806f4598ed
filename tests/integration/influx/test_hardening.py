"""Issue 12, items 1-5 and 10, against a real influxd: the spool never follows a
link nor sends a foreign file's contents; a real full disk (tmpfs) loses only what
the counters say and never half a batch; every point is counted once, also when
InfluxDB refuses some lines of a batch or the spool holds bad lines; a spool that
cannot be written does not cost fresh points, and nothing is sent twice (checked with
influxd's own count of points received); old segment files, 21-digit names included,
are imported; a URL's credentials never reach a log line or a metric.

Item 6 (timeout vs history period, skipped runs) is in tests/unit/history."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from gpudaemon.errors import ConfigError
from gpudaemon.history.lines import encode_line, lines_for
from gpudaemon.history.spool import Spool
from gpudaemon.model import Snapshot
from tests.integration.influx.rig import T0, Clock, Rig
from tests.integration.influx.server import InfluxServer
from tests.integration.influx.tmpfs import fill, resize, small_tmpfs

pytestmark = pytest.mark.integration

DROP_REASONS = ("overflow", "rejected", "spool_error", "invalid")


def ms(t: float) -> int:
    return round(t * 1000)


def stored(influxd: InfluxServer, db: str) -> Counter[int]:
    """Timestamp (ms) -> how many GPUs have a point there."""
    points = {(r.tags["gpu"], round(r.time.timestamp() * 1000)) for r in influxd.points(db)}
    return Counter(t for _, t in points)


def points_received(influxd: InfluxServer) -> int:
    """influxd's own count of points it accepted over HTTP (overwrites included), so a
    point sent twice shows up even though InfluxDB keeps it once."""
    body = json.loads(influxd.influxql("SHOW STATS FOR 'httpd'"))
    series = body["results"][0]["series"][0]
    return int(series["values"][0][series["columns"].index("pointsWrittenOK")])


def dropped(rig: Rig, reason: str | None = None) -> float:
    reasons = [reason] if reason else DROP_REASONS
    return sum(rig.metric("gpudaemon_influxdb_points_dropped_total", reason=r) for r in reasons)


def assert_every_point_counted_once(rig: Rig, influxd: InfluxServer, db: str) -> None:
    got = stored(influxd, db)
    written = rig.metric("gpudaemon_influxdb_points_written_total")
    assert written == sum(got.values()), "points_written_total differs from what InfluxDB holds"
    assert written + dropped(rig) + rig.metric("gpudaemon_influxdb_points_spooled") == 8 * len(
        rig.times
    )


# -- item 1: links and foreign files -----------------------------------------------


def test_a_symlink_in_the_spool_is_never_followed_nor_its_target_sent(
    influxd: InfluxServer, influx_db: str, tmp_path: Path, logs: io.StringIO
) -> None:
    target = tmp_path / "system-file"
    evil = encode_line("gpu", {"node": "evil", "gpu": "9"}, {"power_watts": 1.0}, ms(T0))
    target.write_text(evil + "\n")
    spool = tmp_path / "spool"
    spool.mkdir()
    (spool / f"seg-{1:020d}.lp").symlink_to(target)  # a segment of the old format

    rig = Rig(tmp_path, influxd.url, influx_db, Clock())
    assert "leaving alone 1 entries it does not own: seg-" in logs.getvalue()
    rig.cycle()
    influxd.stop()
    rig.cycle()  # spooled, with the link beside the database
    influxd.start()
    rig.cycle()
    rig.close()

    assert target.read_text() == evil + "\n"
    assert (spool / f"seg-{1:020d}.lp").is_symlink()
    assert {r.tags["node"] for r in influxd.points(influx_db)} == {"node-it"}
    assert stored(influxd, influx_db) == Counter({ms(t): 8 for t in rig.times})


def test_a_spool_database_that_is_a_symlink_refuses_to_start(
    influxd: InfluxServer, influx_db: str, tmp_path: Path
) -> None:
    target = tmp_path / "victim.db"
    target.write_bytes(b"")
    spool = tmp_path / "spool"
    spool.mkdir()
    (spool / "spool.db").symlink_to(target)
    with pytest.raises(ConfigError, match=r"is not usable \(spool.db is a symbolic link\)"):
        Rig(tmp_path, influxd.url, influx_db, Clock())
    assert target.read_bytes() == b""


# -- item 2: a real full disk --------------------------------------------------------


def test_full_disk_loses_only_what_it_counts_and_never_half_a_batch(
    influxd: InfluxServer, influx_db: str, tmp_path: Path
) -> None:
    with small_tmpfs(tmp_path / "mnt", "256k") as mnt:
        rig = Rig(mnt, influxd.url, influx_db, Clock())
        rig.cycle()
        influxd.stop()
        for _ in range(400):
            rig.cycle()
            if dropped(rig, "spool_error") >= 24:
                break
        assert dropped(rig, "spool_error") >= 24, "the 256k tmpfs never filled up"
        assert rig.metric("gpudaemon_influxdb_spool_healthy") == 0
        resize(mnt, "4m")
        rig.cycle()  # spooled again
        assert rig.metric("gpudaemon_influxdb_spool_healthy") == 1
        influxd.start()
        for _ in range(2):
            rig.cycle()
        rig.close()

    assert rig.metric("gpudaemon_influxdb_points_spooled") == 0
    got = stored(influxd, influx_db)
    assert set(got.values()) == {8}, "a batch was stored in part"
    assert dropped(rig) == dropped(rig, "spool_error")
    assert_every_point_counted_once(rig, influxd, influx_db)
    lost = [ms(t) for t in rig.times if ms(t) not in got]
    assert 8 * len(lost) == dropped(rig, "spool_error")


# -- item 3: exact counters ------------------------------------------------------------


def test_lines_influxdb_refuses_cost_only_themselves_and_are_counted_once(
    influxd: InfluxServer, influx_db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gpudaemon.history.writer as writer_mod

    spoil: dict[str, str] = {}  # what to do to GPU 3's line in the next cycle

    def spoiled(snap: Snapshot, node: str) -> list[str]:
        lines = lines_for(snap, node)
        how = spoil.pop("how", "")
        if how == "type":  # power_watts as an integer: a field type conflict
            head, fields, ts = lines[3].rsplit(" ", 2)
            fields = ",".join(
                "power_watts=5i" if f.startswith("power_watts=") else f for f in fields.split(",")
            )
            lines[3] = f"{head} {fields} {ts}"
        elif how == "garbage":  # not line protocol at all
            lines[3] = "gpu,gpu=3 this is not a point"
        elif how == "torn":  # what a short write padded with NUL bytes leaves
            lines[3] = lines[3][:40] + "\x00" * 20
        return lines

    monkeypatch.setattr(writer_mod, "lines_for", spoiled)
    rig = Rig(tmp_path, influxd.url, influx_db, Clock())
    rig.cycle()
    spoil["how"] = "type"
    rig.cycle()  # 7 written, 1 refused as a conflict (InfluxDB says dropped=1)
    spoil["how"] = "garbage"
    rig.cycle()  # 7 written, 1 refused as unparsable (InfluxDB says dropped=0)
    assert rig.metric("gpudaemon_influxdb_points_written_total") == 22
    assert dropped(rig, "rejected") == 2
    influxd.stop()
    spoil["how"] = "torn"
    rig.cycle()  # spooled with a damaged line in it
    spoil["how"] = "garbage"
    rig.cycle()  # and one InfluxDB cannot parse
    influxd.start()
    rig.cycle()
    rig.close()

    assert dropped(rig, "invalid") == 1  # skipped on replay, the rest of its batch sent
    assert dropped(rig, "rejected") == 3  # refused on replay, the rest of its batch stored
    assert rig.metric("gpudaemon_influxdb_points_written_total") == 22 + 7 + 7 + 8
    assert_every_point_counted_once(rig, influxd, influx_db)


# -- item 4: a spool that cannot be written ------------------------------------------


def test_spool_that_cannot_record_sends_costs_no_fresh_point_and_nothing_is_sent_twice(
    influxd: InfluxServer, influx_db: str, tmp_path: Path
) -> None:
    with small_tmpfs(tmp_path / "mnt", "1m") as mnt:
        clock = Clock()
        rig = Rig(mnt, influxd.url, influx_db, clock)
        influxd.stop()
        rig.cycle()
        rig.cycle()  # 16 points wait
        fill(mnt)  # the deletion of sent points cannot be committed now
        influxd.start()
        before = points_received(influxd)
        for _ in range(3):
            rig.cycle()
        assert points_received(influxd) - before == 16 + 24  # each point once
        assert dropped(rig) == 0
        assert rig.metric("gpudaemon_influxdb_points_spooled") == 0
        (mnt / "filler").unlink()
        rig.cycle()
        rig.close()

        again = Rig(mnt, influxd.url, influx_db, clock)  # a restart
        assert again.metric("gpudaemon_influxdb_points_spooled") == 0
        again.cycle()
        again.close()
    assert points_received(influxd) - before == 16 + 24 + 8 + 8
    assert stored(influxd, influx_db) == Counter({ms(t): 8 for t in rig.times + again.times})


def run_once(
    spool: Path, url: str, bucket: str, drop_root_powers: bool
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUDAEMON_")}
    env.update(
        KUBECONFIG="/nonexistent",
        GPUDAEMON_INFLUXDB__URL=url,
        GPUDAEMON_INFLUXDB__BUCKET=bucket,
        GPUDAEMON_INFLUXDB__SPOOL_DIR=str(spool),
        GPUDAEMON_INFLUXDB__TIMEOUT_MS="2000",
    )
    cmd = [sys.executable, "-m", "gpudaemon", "run", "--once", "--simulate", "dgx-h100"]
    cmd += ["--labels-to", "none"]
    if drop_root_powers:
        # Root that obeys file modes, as the agent's non-root user does in its pod.
        caps = "-dac_override,-dac_read_search"
        cmd = ["setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}", "--", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


def test_read_only_spool_dir_is_refused_at_start_and_nothing_is_lost_or_sent_twice(
    influxd: InfluxServer, influx_db: str, tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    bucket = f"{influx_db}/autogen"
    dead = run_once(spool, "http://127.0.0.1:9", bucket, drop_root_powers=False)
    assert dead.returncode == 0, dead.stderr
    s = Spool(spool, max_bytes=1 << 20)
    assert s.points == 8
    s.close()

    spool.chmod(0o555)
    before = points_received(influxd)
    proc = run_once(spool, influxd.url, bucket, drop_root_powers=True)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"gpudaemon: error: influxdb.spool_dir {spool} is not usable")
    assert "(Permission denied)" in line
    assert points_received(influxd) == before

    spool.chmod(0o755)
    for _ in range(2):
        proc = run_once(spool, influxd.url, bucket, drop_root_powers=True)
        assert proc.returncode == 0, proc.stderr
    # 8 spooled + 8 + 8 fresh; the spooled ones not again after the restart
    assert points_received(influxd) - before == 24
    assert sum(stored(influxd, influx_db).values()) == 24


# -- item 10: no credentials in logs or metrics ----------------------------------------


def test_credentials_in_the_url_never_reach_a_log_line_or_a_metric(
    influxd: InfluxServer, influx_db: str, tmp_path: Path, logs: io.StringIO
) -> None:
    secret = "pw-s3cret-4711"
    url = influxd.url.replace("http://", f"http://admin:{secret}@")
    rig = Rig(tmp_path, url, influx_db, Clock(), token=f"admin:{secret}")
    rig.cycle()
    influxd.stop()
    rig.cycle()  # unreachable: the failure is logged
    influxd.start()
    rig.cycle()  # recovery is logged
    rig.close()
    text = logs.getvalue()
    assert "InfluxDB history: http://***@127.0.0.1:" in text
    assert "failed (unreachable)" in text and "accepts writes again" in text
    assert secret not in text
    assert secret.encode() not in generate_latest(rig.registry)
    assert stored(influxd, influx_db) == Counter({ms(t): 8 for t in rig.times})
