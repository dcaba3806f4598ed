"""InfluxDB history: one point per GPU per history run, written synchronously
through the v2 write API, with a durable on-disk spool for outages.

The writer owns batching, replay, spool health and the accounting of every point:
each is counted once, as written or as dropped with its reason. Encoding is in
`lines`, the HTTP client and its error mapping in `transport`, the store in `spool`.
influxdb-client's own batching and retry buffer live in memory, so we write
synchronously and keep what failed in the spool instead: replayed oldest first,
before new points, a bounded amount per run. Timestamps are the reading's sample
time, so sending a point again overwrites rather than duplicates.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Literal

from loguru import logger
from prometheus_client import CollectorRegistry

from gpudaemon.config import AgentSettings, redact_url
from gpudaemon.errors import ConfigError, InfluxWriteError, SpoolError, SpoolLockedError
from gpudaemon.history.lines import lines_for
from gpudaemon.history.metrics import InfluxMetrics
from gpudaemon.history.spool import Spool
from gpudaemon.history.transport import ClientTransport, Scrubber, Transport
from gpudaemon.logsetup import LogLimiter
from gpudaemon.model import Snapshot
from gpudaemon.schedule import parse_cron

# One 10 s cycle of 8 GPUs is ~4 KiB; 4 MiB per cycle drains a day-long outage of
# one node in about two minutes without one cycle taking long.
REPLAY_BYTES_PER_CYCLE = 4 << 20
# One replay request: about 2000 points, well under InfluxDB's recommended 5000 lines.
REPLAY_BYTES_PER_REQUEST = 1 << 20
# During an outage, repeat the same failure in the log at most this often.
LOG_REPEAT_SECONDS = 300.0
# Counting skipped history runs walks the cron; after a longer pause the count stops here.
MAX_SKIPPED_COUNT = 10_000
_DROPPED = re.compile(r"\bdropped=(\d+)")

State = Literal["empty", "more", "down", "stuck"]


def open_spool(spool_dir: str, max_bytes: int) -> Spool:
    """The spool, or a ConfigError (exit 2) naming the key, the path, the OS reason and
    the fix: without a spool every point InfluxDB cannot take at once would be lost."""
    try:
        return Spool(spool_dir, max_bytes)
    except SpoolLockedError as e:
        fix = "stop the other agent, or give each agent its own influxdb.spool_dir"
        reason = e.reason
    except SpoolError as e:
        reason = e.reason
        if "move it away" in str(e):  # a file in the way, not the directory
            why = (
                "the spool only opens its own regular files"
                if "regular files" in str(e)
                else "it cannot be read as the spool (its points are lost)"
            )
            raise ConfigError(
                f"influxdb.spool_dir {spool_dir} is not usable ({reason}): {why}; "
                "move that file away"
            ) from None
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
        cfg: AgentSettings,
        registry: CollectorRegistry,
        transport: Transport | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        replay_bytes_per_cycle: int = REPLAY_BYTES_PER_CYCLE,
        clock: Callable[[], float] = time.time,
    ) -> None:
        ic = cfg.influxdb
        if not ic.bucket:
            raise ConfigError("influxdb.bucket is required when influxdb.url is set")
        self.url = redact_url(ic.url)  # the only form of the URL that is ever logged
        self.node = cfg.node_name
        self.shutdown_flush_seconds = ic.shutdown_flush_seconds
        self.replay_bytes_per_cycle = replay_bytes_per_cycle
        self.replay_bytes_per_request = REPLAY_BYTES_PER_REQUEST
        self.metrics = InfluxMetrics(registry)
        self._monotonic = monotonic
        self._clock = clock
        self._lock = threading.Lock()
        self._last_key: tuple[int, float] | None = None
        self._history_cron = parse_cron(cfg.schedules.history)
        self._last_run: datetime | None = None  # the fire time of the last history run
        self._fail_log = LogLimiter(LOG_REPEAT_SECONDS, monotonic)  # key: error kind
        self._drop_log = LogLimiter(LOG_REPEAT_SECONDS, monotonic)  # key: drop reason
        self._spool_log = LogLimiter(LOG_REPEAT_SECONDS, monotonic)
        self._dropped: dict[str, int] = {}
        self._spool_ok = True
        self._spool_ops: list[bool] = []  # outcomes of this cycle's spool operations
        self._oldest_ms: int | None = None  # timestamp of the oldest spooled point
        self.metrics.spool_oldest_point_age_seconds.set_function(self._oldest_age_seconds)
        self._scrub = Scrubber(ic.url, ic.token.get_secret_value())
        spool_dir = ic.spool_dir  # config.py sets the default when history is on
        self.spool = open_spool(spool_dir, ic.spool_max_bytes)
        try:
            token = cfg.influx_token()
            self._scrub = Scrubber(ic.url, token)
            self.transport: Transport = transport or ClientTransport(
                ic.url, token, ic.org, ic.bucket, ic.timeout_ms
            )
        except BaseException:
            self.spool.close()
            raise
        self.metrics.spool_healthy.set(1)
        self._report_spool_at_start(spool_dir)
        self._update_gauges()
        logger.info(
            "InfluxDB history: {} bucket={} spool={} (max {} bytes)",
            self.url,
            ic.bucket,
            spool_dir,
            ic.spool_max_bytes,
        )

    def _report_spool_at_start(self, spool_dir: str) -> None:
        sp = self.spool
        if sp.foreign:
            logger.warning(
                "InfluxDB spool {}: leaving alone {} entries it does not own: {}",
                spool_dir,
                len(sp.foreign),
                ", ".join(sp.foreign[:10]) + (", ..." if len(sp.foreign) > 10 else ""),
            )
        if sp.points:
            logger.info(
                "InfluxDB spool {} holds {} points from an earlier run; replaying them first",
                spool_dir,
                sp.points,
            )

    # -- the history job ---------------------------------------------------------

    def write(self, snap: Snapshot) -> None:
        """Write the snapshot's points (once per reading), after any spooled ones."""
        with self._lock:
            self._count_skipped_runs()
            key = (snap.sample_seq, snap.samples_at)
            lines = [] if key == self._last_key else lines_for(snap, self.node)
            if lines:
                self._last_key = key
            state = self._replay(self.replay_bytes_per_cycle)
            if lines:
                if state in ("empty", "stuck"):
                    # "stuck": the spool cannot be read or cannot record what was sent;
                    # fresh points still go to InfluxDB rather than into a broken spool.
                    self._send_new(lines)
                else:
                    self._spool(lines)  # keep the order: older points are still waiting
            self._settle_spool_health()
            self._update_gauges()

    def _count_skipped_runs(self) -> None:
        """Count the history schedule's fire times that passed without a run since the
        last run (an overrun, or a paused process). A call off the schedule (the last
        run at shutdown, --once) finds no fire time and counts nothing."""
        now = datetime.fromtimestamp(self._clock(), UTC)
        prev = self._last_run
        if prev is None:
            self._last_run = now  # the next fire time after this is the next run's
            return
        tick = timedelta(microseconds=1)
        fired: list[datetime] = []
        fire = self._history_cron.get_next_fire_time(prev, prev + tick)
        while fire is not None and fire <= now and len(fired) <= MAX_SKIPPED_COUNT:
            fired.append(fire)
            fire = self._history_cron.get_next_fire_time(fire, fire + tick)
        if not fired:
            return
        self._last_run = fired[-1] if fire is None or fire > now else now
        if len(fired) > 1:
            skipped = len(fired) - 1
            self.metrics.runs_skipped.inc(skipped)
            if self._drop_log.allow("skipped-runs"):
                logger.warning(
                    "InfluxDB history skipped {} runs (the previous run overran its period, "
                    "or the process was paused): those readings are not in InfluxDB",
                    skipped,
                )

    def _replay(self, budget_bytes: int) -> State:
        """Send spooled points oldest first, one request per chunk, stopping at the
        first failure or when the budget is spent."""
        sent = 0
        had = self.spool.waiting > 0
        while sent < budget_bytes:
            try:
                chunk = self.spool.oldest(self.replay_bytes_per_request)
            except SpoolError as e:
                self._spool_failed(e)
                return "stuck"
            if chunk is None:
                break
            try:
                written, rejected = self._deliver(chunk.lines) if chunk.lines else (0, 0)
            except InfluxWriteError:
                return "down"
            # InfluxDB has answered for every point of the chunk: count each once.
            self._account(written, rejected, len(chunk.lines), spooled=True)
            if chunk.invalid:
                self._drop(
                    "invalid",
                    chunk.invalid,
                    f"InfluxDB spool: skipped {chunk.invalid} spooled lines that are not "
                    "line protocol",
                )
            try:
                self.spool.ack(chunk)
                self._spool_ops.append(True)
            except SpoolError as e:
                # Not sent again by this process; the deletion is retried later.
                self._spool_failed(e)
            sent += chunk.size_bytes
        if self.spool.waiting:
            return "more"
        if had:
            logger.info("InfluxDB spool drained: every spooled point is written")
        return "empty"

    def _deliver(self, lines: list[bytes]) -> tuple[int, int]:
        """Send `lines`; returns (written, rejected). A refused request that InfluxDB
        says was partly written ("dropped=N") is counted as such; one that does not
        say is split in halves until every refused line is found, so a bad line
        costs only itself. Raises InfluxWriteError when InfluxDB cannot take them now;
        the caller counts nothing then, so a retried point is still counted once."""
        try:
            self._post(b"".join(line + b"\n" for line in lines))
        except InfluxWriteError as e:
            if e.kind != "rejected":
                raise
            # InfluxDB 1.8 counts only field type conflicts and the like in dropped=N,
            # not lines it could not parse ("unable to parse ...: dropped=0").
            m = _DROPPED.search(str(e))
            if m and "unable to parse" not in str(e) and 0 < int(m.group(1)) <= len(lines):
                return len(lines) - int(m.group(1)), int(m.group(1))
            if len(lines) == 1:
                return 0, 1
            half = len(lines) // 2
            w1, r1 = self._deliver(lines[:half])
            w2, r2 = self._deliver(lines[half:])
            return w1 + w2, r1 + r2
        return len(lines), 0

    def _account(self, written: int, rejected: int, total: int, spooled: bool) -> None:
        self.metrics.points_written.inc(written)
        if rejected:
            where = "spooled " if spooled else ""
            self._drop(
                "rejected",
                rejected,
                f"InfluxDB rejected {rejected} of {total} {where}points (written: {written})",
            )

    def _send_new(self, lines: list[str]) -> None:
        data = [line.encode() for line in lines]
        try:
            written, rejected = self._deliver(data)
        except InfluxWriteError:
            self._spool(lines)
            return
        self._account(written, rejected, len(data), spooled=False)

    def _post(self, body: bytes) -> None:
        try:
            self.transport.write(body)
        except InfluxWriteError as e:
            self.metrics.write_errors.labels(e.kind).inc()
            if self._fail_log.allow(e.kind):
                logger.error(
                    "InfluxDB write to {} failed ({}): {}; {}",
                    self.url,
                    e.kind,
                    self._scrub(str(e)),
                    "not retried: InfluxDB refuses these points"
                    if e.kind == "rejected"
                    else f"spooling to disk ({self.spool.waiting} points waiting)",
                )
            raise
        self.metrics.last_success_timestamp_seconds.set(self._clock())
        if self._fail_log.clear():
            logger.info(
                "InfluxDB {} accepts writes again; {} points spooled",
                self.url,
                self.spool.waiting,
            )

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
        if self._spool_log.allow():
            logger.error("InfluxDB spool: {}", e)

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
            self._spool_log.clear()
            logger.info("InfluxDB spool {} takes writes again", self.spool.dir)
        self._spool_ok = ok
        self.metrics.spool_healthy.set(1 if ok else 0)

    def _drop(self, reason: str, points: int, message: str) -> None:
        """Count every dropped point; log the first drop of a kind, then at most every
        LOG_REPEAT_SECONDS, so a permanent problem is one line, not one per cycle."""
        self.metrics.points_dropped.labels(reason).inc(points)
        total = self._dropped[reason] = self._dropped.get(reason, 0) + points
        if self._drop_log.allow(reason):
            logger.warning("{} ({} {} drops since start)", self._scrub(message), total, reason)

    def _update_gauges(self) -> None:
        self.metrics.points_spooled.set(self.spool.waiting)
        self.metrics.spool_bytes.set(self.spool.size_bytes)
        # Unreadable now: keep the last known oldest point (spool_healthy says why).
        with contextlib.suppress(SpoolError):
            self._oldest_ms = self.spool.oldest_timestamp_ms() if self.spool.waiting else None

    def _oldest_age_seconds(self) -> float:
        """Computed at scrape time, so the age grows between history runs."""
        oldest = self._oldest_ms
        return 0.0 if oldest is None else max(0.0, self._clock() - oldest / 1000)

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
            if self.spool.waiting:
                logger.warning(
                    "stopping with {} points in the InfluxDB spool; they are written after "
                    "the next start",
                    self.spool.waiting,
                )
            try:
                self.transport.close()
            except Exception as e:
                logger.error("closing the InfluxDB client: {}", type(e).__name__)
            self.spool.close()
