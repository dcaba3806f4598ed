"""InfluxWriter against a fake transport: point shape, once-per-reading, spooling,
replay order, drops, metrics and the shutdown drain. The real server is in
tests/integration/influx."""

from __future__ import annotations

import base64
import json
import os
import re
import socket
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from gpudaemon import catalogue
from gpudaemon.agent.cache import Cache
from gpudaemon.backends.simulated import SimulatedBackend, load_profile
from gpudaemon.config import Config, load_config, redact_url
from gpudaemon.errors import ConfigError, InfluxWriteError
from gpudaemon.history.lines import encode_line, lines_for
from gpudaemon.history.spool import Spool
from gpudaemon.history.transport import ClientTransport, Scrubber
from gpudaemon.history.writer import InfluxWriter
from gpudaemon.model import GpuSample, Snapshot
from tests.clock import FakeClock
from tests.integration.influx.tmpfs import fill, small_tmpfs


class FakeTransport:
    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.fail: str | None = None  # an error kind to raise
        self.closed = False

    def write(self, body: bytes) -> None:
        if self.fail:
            raise InfluxWriteError(self.fail, f"fake {self.fail}")
        self.bodies.append(body)

    def close(self) -> None:
        self.closed = True

    def timestamps(self) -> list[int]:
        return [int(line.rsplit(b" ", 1)[1]) for b in self.bodies for line in b.splitlines()]


def cfg(tmp_path: Path, **influx: object) -> Config:
    return load_config(
        environ={},
        overrides={
            "node_name": "node-a",
            "influxdb": {
                "url": "http://127.0.0.1:1",
                "bucket": "gpus/autogen",
                "spool_dir": str(tmp_path / "spool"),
                **influx,
            },
        },
    )


class Rig:
    """Simulated dgx-h100 -> cache (injected clock) -> writer (fake transport)."""

    def __init__(self, tmp_path: Path, **influx: object) -> None:
        self.clock = FakeClock()
        self.backend = SimulatedBackend(load_profile("dgx-h100"), seed=1, clock=self.clock)
        self.cache = Cache(self.clock)
        self.cache.put_inventory(self.backend.inventory())
        self.registry = CollectorRegistry()
        self.transport = FakeTransport()
        self.cfg = cfg(tmp_path, **influx)
        self.writer = self.new_writer()

    def new_writer(self) -> InfluxWriter:
        return InfluxWriter(
            self.cfg,
            self.registry,
            transport=self.transport,
            monotonic=self.clock,
            clock=self.clock,
        )

    def cycle(self) -> Snapshot:
        self.clock.t += 10
        self.cache.put_samples(self.backend.sample())
        snap = self.cache.put_energy(self.backend.energy())
        self.writer.write(snap)
        return snap

    def metric(self, name: str, **labels: str) -> float:
        v = self.registry.get_sample_value(name, labels)
        assert v is not None, name
        return v


def test_one_point_per_gpu_with_tags_fields_and_the_sample_time(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    snap = rig.cycle()
    lines = rig.transport.bodies[0].decode().splitlines()
    assert len(lines) == 8
    head, fields, ts = re.split(r"(?<!\\) ", lines[3])
    assert head.startswith("gpu,gpu=3,model=NVIDIA\\ H100\\ 80GB\\ HBM3,node=node-a,uuid=GPU-")
    assert int(ts) == round(snap.samples_at * 1000)
    names = {f.split("=")[0] for f in fields.split(",")}
    # Page retirement is for GPUs before Ampere: absent on an H100, not 0; GPM needs a
    # second poll (a pair of samples): absent on the first, not 0.
    gpm = {"sm_active_ratio", "sm_occupancy_ratio", "tensor_active_ratio"}
    gpm |= {"dram_active_ratio", "fp64_active_ratio"}
    assert {r.influx_field for r in catalogue.rows("gpu") if not r.label} - {
        "retired_pages_pending",
        *gpm,
    } <= names
    assert not gpm & names
    assert "retired_pages_pending" not in names and "row_remap_pending" in names
    assert {"healthy", "xid_errors_total"} <= names
    assert "memory_used_bytes=" in fields and fields.split("memory_used_bytes=")[1][0].isdigit()


def test_absent_readings_are_left_out_not_written_as_zero(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    inv = rig.backend.inventory()
    s = GpuSample(index=0, uuid=inv.gpus[0].uuid, power_watts=None, temperature_celsius=41.0)
    snap = Snapshot(inventory=inv, samples=(s,), samples_at=100.0, sample_seq=1)
    (line,) = lines_for(snap, "n")
    assert "power_watts" not in line
    assert "temperature_celsius=41.0" in line
    assert "ecc_corrected_errors_total" not in line


def test_integer_and_float_fields_keep_their_type(tmp_path: Path) -> None:
    # InfluxDB rejects a field that flips between int and float (field type conflict).
    inv = Rig(tmp_path).backend.inventory()
    s = GpuSample(index=0, uuid="u", temperature_celsius=41, memory_used_bytes=5, process_count=2)  # type: ignore[arg-type]
    (line,) = lines_for(Snapshot(inventory=inv, samples=(s,), samples_at=1.0, sample_seq=1), "n")
    assert "temperature_celsius=41.0" in line
    assert "memory_used_bytes=5i" in line
    assert "processes=2i" in line


def test_line_protocol_escaping_and_non_finite_values() -> None:
    line = encode_line("gpu", {"node": "a b,c=d", "empty": ""}, {"x": 1, "y": float("nan")}, 5)
    assert line == "gpu,node=a\\ b\\,c\\=d x=1i 5"


def test_a_reading_is_written_once_however_often_the_job_runs(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    snap = rig.cycle()
    rig.writer.write(snap)
    rig.writer.write(snap)
    assert len(rig.transport.bodies) == 1
    assert rig.metric("gpudaemon_influxdb_points_written_total") == 8


def test_outage_spools_then_replays_oldest_first_before_new_points(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.cycle()
    assert rig.metric("gpudaemon_influxdb_spool_oldest_point_age_seconds") == 0
    rig.transport.fail = "unreachable"
    first_lost = rig.cycle()
    for _ in range(4):
        rig.cycle()
    assert rig.metric("gpudaemon_influxdb_points_spooled") == 40
    assert rig.metric("gpudaemon_influxdb_write_errors_total", kind="unreachable") == 5
    age = rig.metric("gpudaemon_influxdb_spool_oldest_point_age_seconds")
    assert age == pytest.approx(rig.clock.t - first_lost.samples_at, abs=0.002) and age >= 40
    rig.clock.t += 7  # no history run: the age still grows, read at scrape time
    assert rig.metric("gpudaemon_influxdb_spool_oldest_point_age_seconds") == pytest.approx(
        age + 7, abs=0.002
    )
    rig.transport.fail = None
    rig.cycle()
    assert rig.metric("gpudaemon_influxdb_spool_oldest_point_age_seconds") == 0
    ts = rig.transport.timestamps()
    assert len(ts) == 7 * 8
    assert ts == sorted(ts)  # replayed in order, new points last
    assert len(set(ts)) == 7
    assert rig.metric("gpudaemon_influxdb_points_spooled") == 0
    assert rig.metric("gpudaemon_influxdb_points_written_total") == 56


def test_spool_survives_a_writer_restart(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.transport.fail = "timeout"
    rig.cycle()
    rig.cycle()
    rig.writer.close()
    rig.registry = CollectorRegistry()
    rig.transport = FakeTransport()
    rig.writer = rig.new_writer()
    assert rig.metric("gpudaemon_influxdb_points_spooled") == 16
    assert rig.metric("gpudaemon_influxdb_spool_oldest_point_age_seconds") >= 10  # from disk
    rig.cycle()
    assert len(rig.transport.timestamps()) == 24
    assert rig.transport.timestamps() == sorted(rig.transport.timestamps())


def test_overflow_drops_oldest_and_counts_them(tmp_path: Path) -> None:
    rig = Rig(tmp_path, spool_max_bytes=100_000)
    rig.transport.fail = "server"
    sent = [rig.cycle().samples_at for _ in range(40)]
    dropped = rig.metric("gpudaemon_influxdb_points_dropped_total", reason="overflow")
    spooled = rig.metric("gpudaemon_influxdb_points_spooled")
    assert dropped > 0 and dropped % 8 == 0  # whole readings
    assert dropped + spooled == 320
    assert rig.writer.spool.size_bytes + rig.writer.spool.wal_bytes <= 100_000
    rig.transport.fail = None
    rig.writer.close()  # drains
    got = sorted(set(rig.transport.timestamps()))
    assert got == [round(t * 1000) for t in sent[-len(got) :]]  # the newest survived
    assert len(rig.transport.timestamps()) == spooled


def test_rejected_points_are_dropped_not_spooled(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.transport.fail = "rejected"
    rig.cycle()
    assert rig.metric("gpudaemon_influxdb_points_dropped_total", reason="rejected") == 8
    assert rig.metric("gpudaemon_influxdb_points_spooled") == 0


def test_replay_is_bounded_per_cycle(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.writer.replay_bytes_per_cycle = 1  # one request per cycle
    rig.writer.replay_bytes_per_request = 1  # of one point
    rig.transport.fail = "unreachable"
    for _ in range(4):
        rig.cycle()
    rig.transport.fail = None
    rig.cycle()  # replays one point; the new points wait behind the rest
    assert len(rig.transport.bodies) == 1
    assert rig.metric("gpudaemon_influxdb_points_spooled") == 39
    ts_before = rig.transport.timestamps()
    rig.writer.close()
    ts = ts_before + rig.transport.timestamps()[len(ts_before) :]
    assert ts == sorted(ts) and len(ts) == 40


def test_close_drains_the_spool_and_closes_the_client(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.transport.fail = "unreachable"
    rig.cycle()
    rig.transport.fail = None
    rig.writer.close()
    assert len(rig.transport.timestamps()) == 8
    assert rig.transport.closed


def test_close_with_influxdb_down_keeps_the_spool(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.transport.fail = "unreachable"
    rig.cycle()
    rig.writer.close()
    assert Spool(tmp_path / "spool", max_bytes=1 << 20).points == 8


@pytest.mark.parametrize(
    ("spool_dir", "reason"),
    [
        ("file", "Not a directory"),  # an existing regular file
        ("file/spool", "Not a directory"),  # cannot be created under a file
    ],
)
def test_unusable_spool_dir_at_start_is_a_config_error_naming_key_path_and_reason(
    tmp_path: Path, spool_dir: str, reason: str
) -> None:
    (tmp_path / "file").write_text("a file, not a directory")
    path = tmp_path / spool_dir
    with pytest.raises(ConfigError) as e:
        InfluxWriter(cfg(tmp_path, spool_dir=str(path)), CollectorRegistry(), FakeTransport())
    msg = str(e.value)
    assert f"influxdb.spool_dir {path} is not usable ({reason})" in msg
    assert "mount a writable volume" in msg and "\n" not in msg


def test_spool_locked_by_another_agent_is_a_config_error(tmp_path: Path) -> None:
    first = Rig(tmp_path)
    with pytest.raises(ConfigError, match=r"in use by another process.*own influxdb\.spool_dir"):
        InfluxWriter(first.cfg, CollectorRegistry(), FakeTransport())
    first.writer.close()
    InfluxWriter(first.cfg, CollectorRegistry(), FakeTransport()).close()  # lock released


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB tmpfs for the spool: `fill(disk)` makes it full (ENOSPC for real),
    removing disk / "filler" frees it again."""
    with small_tmpfs(tmp_path / "mnt", "1m") as mnt:
        yield mnt


def test_spool_failing_later_keeps_running_counts_drops_and_clears_the_gauge(
    disk: Path,
) -> None:
    rig = Rig(disk)
    assert rig.metric("gpudaemon_influxdb_spool_healthy") == 1
    rig.transport.fail = "unreachable"
    fill(disk)
    rig.cycle()
    rig.cycle()
    assert rig.metric("gpudaemon_influxdb_spool_healthy") == 0
    assert rig.metric("gpudaemon_influxdb_points_dropped_total", reason="spool_error") == 16
    assert rig.metric("gpudaemon_influxdb_write_errors_total", kind="spool") == 2

    rig.transport.fail = None  # InfluxDB is back: nothing needs the spool, so it is probed
    rig.cycle()
    assert rig.metric("gpudaemon_influxdb_spool_healthy") == 0  # still full
    assert rig.metric("gpudaemon_influxdb_points_written_total") == 8
    (disk / "filler").unlink()
    rig.cycle()
    assert rig.metric("gpudaemon_influxdb_spool_healthy") == 1
    assert not (disk / "spool" / ".probe").exists()  # the probe cleans up


def test_points_that_cannot_be_marked_sent_are_not_sent_twice_and_fresh_ones_go_direct(
    disk: Path,
) -> None:
    """Item 4's class: the spool cannot record that points were sent (here: a full
    disk), while InfluxDB is up. Fresh points must still be written, none dropped,
    and the spooled ones sent once."""
    rig = Rig(disk)
    rig.transport.fail = "unreachable"
    rig.cycle()
    rig.cycle()  # 16 points wait
    fill(disk)
    rig.transport.fail = None
    for _ in range(3):
        rig.cycle()
    ts = rig.transport.timestamps()
    assert len(ts) == 5 * 8 and len(set(ts)) == 5  # every point once
    assert rig.metric("gpudaemon_influxdb_points_written_total") == 40
    for reason in ("spool_error", "overflow", "rejected", "invalid"):
        assert rig.metric("gpudaemon_influxdb_points_dropped_total", reason=reason) == 0
    assert rig.metric("gpudaemon_influxdb_points_spooled") == 0
    assert rig.metric("gpudaemon_influxdb_spool_healthy") == 0
    (disk / "filler").unlink()
    rig.cycle()  # the probe also commits the deletion that had to wait
    assert rig.metric("gpudaemon_influxdb_spool_healthy") == 1
    rig.writer.close()
    rig.transport = FakeTransport()
    rig.registry = CollectorRegistry()
    rig.writer = rig.new_writer()  # a restart: nothing is sent again
    assert rig.metric("gpudaemon_influxdb_points_spooled") == 0
    rig.cycle()
    assert len(rig.transport.timestamps()) == 8


def test_a_spool_that_keeps_failing_is_one_log_line_per_repeat_interval(disk: Path) -> None:
    from loguru import logger

    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m)), level="WARNING")
    try:
        rig = Rig(disk)
        rig.transport.fail = "unreachable"
        fill(disk)
        for _ in range(5):
            rig.cycle()
    finally:
        logger.remove(sink)
    assert rig.metric("gpudaemon_influxdb_points_dropped_total", reason="spool_error") == 40
    assert len([line for line in lines if "No space left" in line]) == 2  # error + drop


def test_bucket_is_required(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="bucket"):
        InfluxWriter(cfg(tmp_path, bucket=""), CollectorRegistry(), transport=FakeTransport())


# -- the real client against sockets that misbehave ------------------------------


def test_refused_connection_is_unreachable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens
    t = ClientTransport(f"http://127.0.0.1:{port}", "tok", "", "db", timeout_ms=1000)
    with pytest.raises(InfluxWriteError) as e:
        t.write(b"gpu x=1i 1\n")
    assert e.value.kind == "unreachable"
    t.close()


def test_silent_server_times_out_within_timeout_ms() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)  # the kernel accepts; nobody ever answers
        port = s.getsockname()[1]
        t = ClientTransport(f"http://127.0.0.1:{port}", "tok", "", "db", timeout_ms=300)
        with pytest.raises(InfluxWriteError) as e:
            t.write(b"gpu x=1i 1\n")
        t.close()
    assert e.value.kind == "timeout"


def _one_request(url_for: Callable[[int], str], token: str) -> bytes:
    """The raw request a ClientTransport sends, answered 204 by a one-shot socket."""
    got: list[bytes] = []
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)

        def serve() -> None:
            conn, _ = s.accept()
            with conn:
                data = b""
                while b"gpu x=1i" not in data:
                    data += conn.recv(65536)
                got.append(data)
                conn.sendall(b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n")

        th = threading.Thread(target=serve)
        th.start()
        t = ClientTransport(url_for(s.getsockname()[1]), token, "", "db", timeout_ms=5000)
        t.write(b"gpu x=1i 1\n")
        t.close()
        th.join(5)
    return got[0]


def test_credentials_in_the_url_become_basic_auth_and_leave_the_request_line() -> None:
    raw = _one_request(lambda p: f"http://we%20b:p%40ss@127.0.0.1:{p}/x", token="")
    head = raw.split(b"\r\n\r\n")[0].decode()
    assert head.startswith("POST /x/api/v2/write?") and "p%40ss" not in head
    basic = base64.b64encode(b"we b:p@ss").decode()
    auth = [v for line in head.split("\r\n")[1:]
            for k, _, v in [line.partition(": ")] if k.lower() == "authorization"]  # fmt: skip
    assert auth == [f"Basic {basic}"]
    # A token, when given, wins over the URL's credentials.
    raw = _one_request(lambda p: f"http://u:pw@127.0.0.1:{p}", token="admin:tok")
    assert b"Token admin:tok" in raw and b"Basic" not in raw


def test_a_permanent_problem_is_one_log_line_not_one_per_cycle(tmp_path: Path) -> None:
    from loguru import logger

    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m)), level="WARNING")
    try:
        rig = Rig(tmp_path)
        rig.transport.fail = "rejected"
        for _ in range(5):
            rig.cycle()
    finally:
        logger.remove(sink)
    assert rig.metric("gpudaemon_influxdb_points_dropped_total", reason="rejected") == 40
    assert len([line for line in lines if "rejected" in line]) == 2  # the failure + the drop


# -- issue 12: exact counts, skipped runs, the timeout rule, secrets --------------


class PartialTransport(FakeTransport):
    """Like InfluxDB 1.8: lines containing `bad` cannot be parsed (HTTP 400, the rest
    of the body is written, "dropped=0"); lines containing `conflict` are refused
    with "dropped=N"."""

    def __init__(self) -> None:
        super().__init__()
        self.requests = 0

    def write(self, body: bytes) -> None:
        self.requests += 1
        lines = body.splitlines()
        bad = [x for x in lines if b"BAD" in x]
        conflict = [x for x in lines if b"CONFLICT" in x]
        self.bodies.append(b"\n".join(x for x in lines if x not in bad and x not in conflict))
        if bad:
            raise InfluxWriteError(
                "rejected",
                "HTTP 400: partial write: unable to parse "
                f"'{bad[0].decode()[:20]}': invalid dropped={len(conflict)}",
            )
        if conflict:
            raise InfluxWriteError(
                "rejected", f"HTTP 400: partial write: field type conflict dropped={len(conflict)}"
            )


@pytest.mark.parametrize("marker", ["BAD", "CONFLICT"])
def test_a_refused_line_costs_only_itself_and_every_point_is_counted_once(
    tmp_path: Path, marker: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gpudaemon.history.writer as writer_mod

    def with_one_bad(snap: Snapshot, node: str) -> list[str]:
        lines = lines_for(snap, node)
        lines[3] = lines[3].replace("gpu,", f"gpu,{marker.lower()}={marker},", 1)
        return lines

    monkeypatch.setattr(writer_mod, "lines_for", with_one_bad)
    rig = Rig(tmp_path)
    rig.transport = rig.writer.transport = PartialTransport()  # type: ignore[assignment]
    rig.cycle()
    assert rig.metric("gpudaemon_influxdb_points_written_total") == 7
    assert rig.metric("gpudaemon_influxdb_points_dropped_total", reason="rejected") == 1


def test_skipped_history_runs_are_counted(tmp_path: Path) -> None:
    rig = Rig(tmp_path)  # history every 10 s; the clock moves 10 s per cycle
    for _ in range(3):
        rig.cycle()
    assert rig.metric("gpudaemon_influxdb_history_runs_skipped_total") == 0
    rig.clock.advance(20)  # the runs at +10 s and +20 s never happened
    rig.cycle()
    assert rig.metric("gpudaemon_influxdb_history_runs_skipped_total") == 2
    rig.clock.advance(3)  # a run off the schedule (shutdown, --once) counts nothing
    rig.writer.write(rig.cache.get())
    rig.cycle()
    assert rig.metric("gpudaemon_influxdb_history_runs_skipped_total") == 2


@pytest.mark.parametrize(
    ("history", "timeout_ms", "ok"),
    [
        ("*/10 * * * * *", 9_999, True),
        ("*/10 * * * * *", 10_000, False),
        ("* * * * * *", 5_000, False),
        ("0,1 * * * * *", 1_000, False),  # the shortest gap counts
        ("*/5 * * * *", 60_000, True),
    ],
)
def test_timeout_at_or_above_the_history_period_is_refused_at_load(
    tmp_path: Path, history: str, timeout_ms: int, ok: bool
) -> None:
    overrides = {
        "influxdb": {"url": "http://127.0.0.1:1", "bucket": "b", "timeout_ms": timeout_ms},
        "schedules": {"history": history},
    }
    if ok:
        load_config(environ={}, overrides=overrides)
        return
    with pytest.raises(ConfigError) as e:
        load_config(environ={}, overrides=overrides)
    assert "influxdb.timeout_ms" in str(e.value) and "history period" in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("http://user:pw-4711@influx:8086/x", "http://***@influx:8086/x"),
        ("https://tok-4711@influx", "https://***@influx"),
        ("http://influx:8086", "http://influx:8086"),
    ],
)
def test_urls_are_logged_without_their_credentials(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    scrub = Scrubber(url, "admin:token-4711")
    assert "4711" not in scrub(f"failed {url} with admin:token-4711 and token-4711")


@pytest.mark.parametrize("kind", ["symlink", "fifo", "device"])
def test_spool_database_that_is_not_a_regular_file_is_a_config_error(
    tmp_path: Path, kind: str
) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    db = spool / "spool.db"
    if kind == "symlink":
        db.symlink_to(tmp_path / "elsewhere")
    elif kind == "fifo":
        os.mkfifo(db)
    else:
        os.mknod(db, stat.S_IFCHR | 0o600, os.makedev(1, 3))
    with pytest.raises(ConfigError) as e:
        InfluxWriter(cfg(tmp_path), CollectorRegistry(), FakeTransport())
    assert f"influxdb.spool_dir {spool} is not usable (spool.db is a" in str(e.value)
    assert "move that file away" in str(e.value)
    assert not (tmp_path / "elsewhere").exists()


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (401, "unauthorized"),
        (403, "unauthorized"),
        (404, "not_found"),
        (400, "rejected"),
        (409, "rejected"),
        (413, "rejected"),
        (429, "server"),
        (503, "server"),
        (None, "server"),
    ],
)
def test_http_status_maps_to_the_error_kind(status: int | None, kind: str) -> None:
    from gpudaemon.history.transport import _http_error

    assert _http_error(status, "x", b'{"error": "no"}').kind == kind


def test_a_long_partial_write_message_keeps_its_dropped_count() -> None:
    from gpudaemon.history.transport import _http_error

    body = json.dumps({"error": "partial write: field type conflict: " + "x" * 500 + " dropped=7"})
    e = _http_error(400, "Bad Request", body.encode())
    assert len(str(e)) < 300 and str(e).endswith("dropped=7")


def test_a_bad_url_with_credentials_is_refused_without_showing_them() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(
            environ={},
            overrides={"influxdb": {"url": "ftp://admin:pw-4711@influx:8086", "bucket": "b"}},
        )
    assert "ftp://***@influx:8086" in str(e.value) and "4711" not in str(e.value)


def test_a_damaged_spool_database_is_a_config_error_saying_what_to_do(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.transport.fail = "unreachable"
    for _ in range(30):
        rig.cycle()
    rig.writer.close()
    db = tmp_path / "spool" / "spool.db"
    data = bytearray(db.read_bytes())
    data[4096 : 4096 * 3] = b"\xff" * 8192  # pages of the table, as a failing disk leaves
    db.write_bytes(bytes(data))
    with pytest.raises(ConfigError) as e:
        InfluxWriter(cfg(tmp_path), CollectorRegistry(), FakeTransport())
    msg = str(e.value)
    assert "(spool.db: " in msg and "move that file away" in msg and "\n" not in msg


def test_the_request_is_influxdb_client_s_write() -> None:
    """The body goes through influxdb-client's WriteApi (issue 29): its User-Agent, its
    query (bucket, precision=ms), our token."""
    raw = _one_request(lambda p: f"http://127.0.0.1:{p}", token="tok")
    head = raw.split(b"\r\n\r\n")[0].decode()
    line, *headers = head.split("\r\n")
    assert line.startswith("POST /api/v2/write?") and "bucket=db" in line
    assert "precision=ms" in line
    fields = {k.lower(): v for k, _, v in (h.partition(": ") for h in headers)}
    assert fields["user-agent"].startswith("influxdb-client-python/")
    assert fields["authorization"] == "Token tok"


def test_the_client_s_errors_become_ours() -> None:
    from influxdb_client.rest import ApiException

    from gpudaemon.history.transport import _client_error

    tls = ApiException(status=0, reason="SSLError\n[SSL: CERTIFICATE_VERIFY_FAILED] no")
    e = _client_error(tls)
    assert e.kind == "unreachable" and "\n" not in str(e) and "CERTIFICATE" in str(e)
    e = _client_error(ApiException(status=503, reason="Service Unavailable"))
    assert e.kind == "server" and "HTTP 503" in str(e)
    assert _client_error(ApiException(status=401, reason="Unauthorized")).kind == "unauthorized"
    assert _client_error(ValueError("odd")).kind == "server"
