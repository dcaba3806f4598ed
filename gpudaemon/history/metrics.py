"""The InfluxDB writer's own series: points written, spooled, replayed and dropped by
reason, the spool's size and age, and the write duration."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

ERROR_KINDS = ("unauthorized", "not_found", "rejected", "server", "timeout", "unreachable", "spool")
DROP_REASONS = ("overflow", "rejected", "spool_error", "invalid")


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
            "Line-protocol bytes in the on-disk spool (what influxdb.spool_max_bytes bounds).",
            registry=registry,
        )
        self.spool_oldest_point_age_seconds = Gauge(
            "gpudaemon_influxdb_spool_oldest_point_age_seconds",
            "Age of the oldest point waiting in the spool (0 when none waits): how far "
            "behind InfluxDB's copy of this node's history is.",
            registry=registry,
        )
        self.points_dropped = Counter(
            "gpudaemon_influxdb_points_dropped",
            "Points given up on, by reason (overflow: spool bound, oldest first; "
            "rejected: InfluxDB refused them; spool_error: the spool could not be written; "
            "invalid: a spooled line that is not line protocol).",
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
        self.runs_skipped = Counter(
            "gpudaemon_influxdb_history_runs_skipped",
            "History runs that did not happen (the previous run overran its period, or the "
            "process was paused): each is one reading that is not in InfluxDB.",
            registry=registry,
        )
        for kind in ERROR_KINDS:
            self.write_errors.labels(kind)
        for reason in DROP_REASONS:
            self.points_dropped.labels(reason)
