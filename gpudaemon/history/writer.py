"""InfluxDB history: one point per GPU per history run, written synchronously
through the v2 write API, with a durable on-disk spool for outages.

The writer owns batching, replay, spool health and drop accounting; encoding is in
`lines`, the HTTP client and its error mapping in `transport`. influxdb-client's own
batching and retry buffer live in memory, so we write synchronously and keep what
failed in a `Spool` instead: replayed oldest first, before new points, a bounded
amount per cycle. Timestamps are the reading's sample time, so a replay overwrites
rather than duplicates.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Literal

from loguru import logger
from prometheus_client import CollectorRegistry, Counter, Gauge

from gpudaemon.config import Config
from gpudaemon.errors import ConfigError, InfluxWriteError, SpoolError, SpoolLockedError
from gpudaemon.history.lines import lines_for
from gpudaemon.history.spool import Spool
from gpudaemon.history.transport import ClientTransport, Transport
from gpudaemon.model import Snapshot

DEFAULT_SPOOL_DIR = "/var/lib/gpudaemon/spool"
ERROR_KINDS = ("unauthorized", "not_found", "rejected", "server", "timeout", "unreachable", "spool")
DROP_REASONS = ("overflow", "rejected", "spool_error")
# One 10 s cycle of 8 GPUs is ~4 KiB; 4 MiB per cycle drains a day-long outage of
# one node in about two minutes without one cycle taking long.
REPLAY_BYTES_PER_CYCLE = 4 << 20
# During an outage, repeat the same failure in the log at most this often.
LOG_REPEAT_SECONDS = 300.0


class InfluxMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.points_written = Counter(
            "gpudaemon_influxdb_points_written",
            "Points InfluxDB accepted (new and replayed from the spool).",
            registry=registry,
        )
        self.points_spooled = Gauge(
            "gpudaemon_influxdb_points_spooled",
            "Points waiting in the on-disk spool for InfluxDB to come back.",
            registry=registry,
        )
        self.spool_bytes = Gauge(
            "gpudaemon_influxdb_spool_bytes",
            "Size of the on-disk spool.",
            registry=registry,
        )
        self.points_dropped = Counter(
            "gpudaemon_influxdb_points_dropped",
            "Points given up on, by reason (overflow: spool bound, oldest first; "
            "rejected: InfluxDB refused them; spool_error: the spool could not be written).",
            ["reason"],
            registry=registry,
        )
        self.write_errors = Counter(
            "gpudaemon_influxdb_write_errors",
            "Failed write requests to InfluxDB, by kind.",
            ["kind"],
            registry=registry,
        )
        self.spool_healthy = Gauge(
            "gpudaemon_influxdb_spool_healthy",
            "1 while the on-disk spool takes writes, 0 after a spool I/O error (disk full, "
            "EIO) until a later write or probe succeeds; points that could not be spooled "
            'are in points_dropped_total{reason="spool_error"}.',
            registry=registry,
        )
        self.last_success_timestamp_seconds = Gauge(
            "gpudaemon_influxdb_last_success_timestamp_seconds",
            "UNIX time of the last write InfluxDB accepted.",
            registry=registry,
        )
        for kind in ERROR_KINDS:
            self.write_errors.labels(kind)
        for reason in DROP_REASONS:
            self.points_dropped.labels(reason)


def open_spool(spool_dir: str, max_bytes: int) -> Spool:
    """The spool, or a ConfigError (exit 2) naming the key, the path, the OS reason and
    the fix: without a spool every point InfluxDB cannot take at once would be lost."""
    try:
        return Spool(spool_dir, max_bytes)
    except SpoolLockedError as e:
        fix = "stop the other agent, or give each agent its own influxdb.spool_dir"
        reason = e.reason
    except SpoolError as e:
        fix = (
            "mount a writable volume there (emptyDir, or hostPath to survive pod "
            "re-creation) or set influxdb.spool_dir (GPUDAEMON_INFLUXDB__SPOOL_DIR) "
            "to a writable directory"
        )
        reason = e.reason
    raise ConfigError(
        f"influxdb.spool_dir {spool_dir} is not usable ({reason}); points InfluxDB cannot "
        f"take at once would be lost: {fix}"
    )


class InfluxWriter:
    """The history sink: `write(snapshot)` on the history schedule, `close()` at exit."""

    def __init__(
        self,
        cfg: Config,
        registry: CollectorRegistry,
        transport: Transport | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        replay_bytes_per_cycle: int = REPLAY_BYTES_PER_CYCLE,
    ) -> None:
        ic = cfg.influxdb
        if not ic.bucket:
            raise ConfigError("influxdb.bucket is required when influxdb.url is set")
        self.url = ic.url
        self.node = cfg.node_name
        self.shutdown_flush_seconds = ic.shutdown_flush_seconds
        self.replay_bytes_per_cycle = replay_bytes_per_cycle
        self.metrics = InfluxMetrics(registry)
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._last_key: tuple[int, float] | None = None
        self._failing: str | None = None  # error kind while InfluxDB is failing
        self._last_log = -LOG_REPEAT_SECONDS
        self._last_drop_log: dict[str, float] = {}
        self._dropped: dict[str, int] = {}
        self._spool_ok = True
        self._spool_ops: list[bool] = []  # outcomes of this cycle's spool operations
        self._last_spool_log = -LOG_REPEAT_SECONDS
        spool_dir = ic.spool_dir or DEFAULT_SPOOL_DIR
        self.spool = open_spool(spool_dir, ic.spool_max_bytes)
        try:
            self.transport: Transport = transport or ClientTransport(
                ic.url, cfg.influx_token(), ic.org, ic.bucket, ic.timeout_ms
            )
        except BaseException:
            self.spool.close()
            raise
        self.metrics.spool_healthy.set(1)
        if self.spool.points:
            logger.info(
                "InfluxDB spool {} holds {} points from an earlier run; replaying them first",
                spool_dir,
                self.spool.points,
            )
        self._update_gauges()
        logger.info(
            "InfluxDB history: {} bucket={} spool={} (max {} bytes)",
            ic.url,
            ic.bucket,
            spool_dir,
            ic.spool_max_bytes,
        )

    # -- the history job ---------------------------------------------------------

    def write(self, snap: Snapshot) -> None:
        """Write the snapshot's points (once per reading), after any spooled ones."""
        with self._lock:
            key = (snap.sample_seq, snap.samples_at)
            lines = [] if key == self._last_key else lines_for(snap, self.node)
            if lines:
                self._last_key = key
            state = self._replay(self.replay_bytes_per_cycle)
            if lines:
                if state == "empty":
                    self._send_new(lines)
                else:
                    self._spool(lines)  # keep the order: older points are still waiting
            self._settle_spool_health()
            self._update_gauges()

    def _send_new(self, lines: list[str]) -> None:
        try:
            self._send("".join(line + "\n" for line in lines).encode(), len(lines))
        except InfluxWriteError as e:
            if e.kind == "rejected":
                self._drop("rejected", len(lines), f"InfluxDB rejected {len(lines)} points: {e}")
            else:
                self._spool(lines)

    def _replay(self, budget_bytes: int) -> Literal["empty", "more", "failed"]:
        """Send spooled segments oldest first, stopping at the first failure or when
        the budget is spent."""
        sent = 0
        try:
            while (seg := self.spool.oldest()) is not None and sent < budget_bytes:
                body = self.spool.read(seg)
                try:
                    self._send(body, seg.points)
                except InfluxWriteError as e:
                    if e.kind != "rejected":
                        return "failed"
                    # Replaying a refused batch again cannot succeed; don't let it block.
                    self._drop(
                        "rejected",
                        seg.points,
                        f"InfluxDB rejected {seg.points} spooled points: {e}",
                    )
                self.spool.remove(seg)
                self._spool_ops.append(True)
                sent += len(body)
                if self.spool.oldest() is None:
                    logger.info("InfluxDB spool drained: every spooled point is written")
        except SpoolError as e:
            self._spool_failed(e)
            return "failed"
        return "empty" if self.spool.oldest() is None else "more"

    def _send(self, body: bytes, points: int) -> None:
        try:
            self.transport.write(body)
        except InfluxWriteError as e:
            self.metrics.write_errors.labels(e.kind).inc()
            self._log_failure(e)
            raise
        self.metrics.points_written.inc(points)
        self.metrics.last_success_timestamp_seconds.set_to_current_time()
        if self._failing is not None:
            logger.info(
                "InfluxDB {} accepts writes again; {} points spooled",
                self.url,
                self.spool.points,
            )
            self._failing = None

    def _spool(self, lines: list[str]) -> None:
        try:
            dropped = self.spool.append(lines)
        except SpoolError as e:
            self._spool_failed(e)
            self._drop("spool_error", len(lines), f"cannot spool {len(lines)} points: {e}")
            return
        self._spool_ops.append(True)
        if dropped:
            self._drop(
                "overflow",
                dropped,
                f"InfluxDB spool over its bound of {self.spool.max_bytes} bytes: "
                f"dropped the {dropped} oldest points",
            )

    def _spool_failed(self, e: SpoolError) -> None:
        self.metrics.write_errors.labels("spool").inc()
        self._spool_ops.append(False)
        now = self._monotonic()
        first = self._spool_ok and self._spool_ops.count(False) == 1  # since it was healthy
        if first or now - self._last_spool_log >= LOG_REPEAT_SECONDS:
            logger.error("InfluxDB spool: {}", e)
            self._last_spool_log = now

    def _settle_spool_health(self) -> None:
        """Healthy unless a spool operation failed this cycle. A cycle that needed no
        spool (InfluxDB up, nothing waiting) probes it while it is marked unhealthy, so
        the gauge clears once the disk is fixed rather than at the next outage."""
        ops, self._spool_ops = self._spool_ops, []
        if not ops and not self._spool_ok:
            try:
                self.spool.probe()
                ops = [True]
            except SpoolError as e:
                self._spool_failed(e)
                ops, self._spool_ops = self._spool_ops, []
        if not ops:
            return
        ok = all(ops)
        if ok and not self._spool_ok:
            logger.info("InfluxDB spool {} takes writes again", self.spool.dir)
        self._spool_ok = ok
        self.metrics.spool_healthy.set(1 if ok else 0)

    def _drop(self, reason: str, points: int, message: str) -> None:
        """Count every dropped point; log the first drop of a kind, then at most every
        LOG_REPEAT_SECONDS, so a permanent problem is one line, not one per cycle."""
        self.metrics.points_dropped.labels(reason).inc(points)
        total = self._dropped[reason] = self._dropped.get(reason, 0) + points
        now = self._monotonic()
        last = self._last_drop_log.get(reason)
        if last is None or now - last >= LOG_REPEAT_SECONDS:
            logger.warning("{} ({} {} drops since start)", message, total, reason)
            self._last_drop_log[reason] = now

    def _log_failure(self, e: InfluxWriteError) -> None:
        now = self._monotonic()
        if e.kind != self._failing or now - self._last_log >= LOG_REPEAT_SECONDS:
            logger.error(
                "InfluxDB write to {} failed ({}): {}; spooling to disk ({} points waiting)",
                self.url,
                e.kind,
                e,
                self.spool.points,
            )
            self._last_log = now
        self._failing = e.kind

    def _update_gauges(self) -> None:
        self.metrics.points_spooled.set(self.spool.points)
        self.metrics.spool_bytes.set(self.spool.size_bytes)

    # -- shutdown ----------------------------------------------------------------

    def close(self) -> None:
        """Drain the spool for at most shutdown_flush_seconds (plus one request's
        timeout); whatever is left stays on disk for the next start."""
        with self._lock:
            deadline = self._monotonic() + self.shutdown_flush_seconds
            while self._monotonic() < deadline:
                if self._replay(self.replay_bytes_per_cycle) != "more":
                    break
            self._update_gauges()
            if self.spool.points:
                logger.warning(
                    "stopping with {} points in the InfluxDB spool; they are written after "
                    "the next start",
                    self.spool.points,
                )
            try:
                self.transport.close()
            except Exception as e:
                logger.error("closing the InfluxDB client: {}", type(e).__name__)
            self.spool.close()
