"""The agent's configuration: its own sections (schedules, metrics, influxdb, health),
its top-level keys (node_name, simulate) and `AgentFields`, what `AgentSettings` (the
model `gpudaemon run` and `gpudaemon probe` validate, in programs.py) is made of."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from typing import Annotated, Self

from pydantic import (
    AfterValidator,
    Field,
    SecretStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from gpudaemon.config.files import influx_token
from gpudaemon.config.remediation import RemediationConfig
from gpudaemon.config.sections import (
    DraConfig,
    KubernetesConfig,
    LabelsConfig,
    LoggingConfig,
)
from gpudaemon.config.values import (
    DNS1123_SUBDOMAIN,
    Cron,
    CronOrNone,
    ListenAddress,
    Number,
    WholeNumber,
    _check_influx_url,
    _Section,
)
from gpudaemon.errors import CronError
from gpudaemon.schedule import parse_cron

# Where history waits while InfluxDB is down (a hostPath or emptyDir in the chart).
DEFAULT_SPOOL_DIR = "/var/lib/gpudaemon/spool"


class Schedules(_Section):
    # 5 s telemetry matches a 15-30 s Prometheus scrape with headroom, at ~0.1% CPU.
    telemetry: Cron = "*/5 * * * * *"
    # Inventory (models, MIG layout, driver) changes rarely; 5 min bounds detection lag.
    inventory: Cron = "0 */5 * * * *"
    # Label reconcile; it writes only on change, so running often is cheap.
    labels: Cron = "*/30 * * * * *"
    # History flush to InfluxDB: 10 s resolution is plenty for capacity planning.
    history: Cron = "*/10 * * * * *"
    # Pod attribution (kubelet pod-resources List): pods start in seconds, so 10 s
    # keeps the pod label close to the truth for one cheap local gRPC call.
    pods: Cron = "*/10 * * * * *"
    # The energy counter (gpu_energy_joules_total): ~3.9 ms per read on an H100, 100x a
    # whole telemetry sample, so its own schedule; 30 s suits rate() over the usual 2-5
    # min windows at 0.1% of a core for 8 GPUs. "none" turns it off.
    energy: CronOrNone = "*/30 * * * * *"
    # The slower GPU health counters (NVLink error counters: 4 calls per link, 72 on an
    # H100; retired pages; the recovery action; clock-event durations): ~0.2-0.4 ms per
    # GPU (estimated, docs/benchmarks.md), so not in every sample. Row remapping and
    # clock events are in every sample; XID 154 re-reads the recovery action at once.
    health: CronOrNone = "*/30 * * * * *"

    @field_validator("telemetry", "inventory", "labels", "history", "pods", "energy", "health")
    @classmethod
    def _cron(cls, v: str, info: ValidationInfo) -> str:
        if info.field_name in ("energy", "health") and v == "none":
            return v
        try:
            parse_cron(v)
        except CronError as e:
            raise ValueError(str(e)) from None
        return v


class MetricsConfig(_Section):
    listen: ListenAddress = "0.0.0.0:9445"
    # /readyz turns not-ready when the newest reading is older than this: three
    # missed 5 s telemetry polls plus scheduling slack.
    stale_after_seconds: Annotated[Number, Field(gt=0, le=86400)] = 30.0
    # The kubelet pod-resources socket; a missing file means no pod labels. Empty: off.
    pod_resources_socket: str = "/var/lib/kubelet/pod-resources/kubelet.sock"


class InfluxConfig(_Section):
    # empty: history is off; http://user:password@host sends Basic auth unless a token is set
    url: Annotated[str, AfterValidator(_check_influx_url)] = ""
    org: str = ""
    bucket: str = ""
    token_file: str = ""
    # Only from the environment (GPUDAEMON_INFLUXDB__TOKEN) or the file above; never a flag.
    token: SecretStr = SecretStr("")
    spool_dir: str = ""  # empty: /var/lib/gpudaemon/spool when history is on
    # 256 MiB holds about a week of 8-GPU history at 10 s resolution.
    spool_max_bytes: Annotated[WholeNumber, Field(gt=0, le=1 << 40)] = 268_435_456
    timeout_ms: Annotated[WholeNumber, Field(gt=0, le=600_000)] = 5_000
    # On SIGTERM, replay the spool for at most this long (plus one timeout_ms): well
    # inside Kubernetes' default 30 s grace period; the rest stays on disk.
    shutdown_flush_seconds: Annotated[Number, Field(ge=0, le=3600)] = 10.0


class HealthConfig(_Section):
    # Where a critical XID or uncorrected ECC fault is remembered across agent restarts
    # until the node reboots (a new boot ID). "auto": /var/lib/gpudaemon/health.json
    # with real NVML, nothing with simulated GPUs (a laptop demo writes no state);
    # "" turns it off. The chart mounts /var/lib/gpudaemon from the host.
    state_file: str = "auto"


def check_history_timeout(timeout_ms: int, history: str) -> None:
    """One InfluxDB request may take timeout_ms; at or above the history period a
    run overruns and the next one (its reading) is skipped. (History issue 12 item 6.)"""
    trigger = parse_cron(history)
    fire = trigger.get_next_fire_time(None, datetime(2026, 1, 1, tzinfo=UTC))
    period = math.inf
    for _ in range(200):  # the shortest gap between runs, over the first 200 runs
        if fire is None:
            break
        nxt = trigger.get_next_fire_time(fire, fire + timedelta(microseconds=1))
        if nxt is not None:
            period = min(period, (nxt - fire).total_seconds())
        fire = nxt
    if timeout_ms >= period * 1000:
        raise ValueError(
            f"influxdb.timeout_ms ({timeout_ms}) must be below the history period "
            f"({period * 1000:.0f} ms between runs of schedules.history {history!r}): "
            "a write that takes that long makes the next history run skip its reading"
        )


def history_defaults(influxdb: InfluxConfig, schedules: Schedules) -> None:
    """With history on: the spool's default place, and a timeout below the period.
    (The token file is read when the agent starts: config/files.py.)"""
    if influxdb.url:
        if not influxdb.spool_dir:
            influxdb.spool_dir = DEFAULT_SPOOL_DIR
        check_history_timeout(influxdb.timeout_ms, schedules.history)


class NodeFields(_Section):
    """The agent's top-level keys: `AgentSettings` and `Config` (the whole file) share them."""

    # Empty: $NODE_NAME, then the lower-cased hostname, as kubelet names the Node
    # (resolved when the config is loaded).
    node_name: str = ""
    simulate: str | None = None  # absent: real NVML
    simulate_seed: Annotated[WholeNumber, Field(ge=0, le=2**64 - 1)] | None = None

    @model_validator(mode="after")
    def _node(self) -> Self:
        # It goes into API paths: only a valid Node name (DNS-1123 subdomain) may. The
        # extender, the rebalancer and `status` have no node_name: a hostname that is no
        # Node name (an underscore, say) does not stop them.
        if len(self.node_name) > 253 or not DNS1123_SUBDOMAIN.fullmatch(self.node_name):
            raise ValueError(
                f"node_name {self.node_name!r} is not a valid Node name "
                "(lower-case letters, digits, '-' and '.', at most 253 characters); "
                "set it with --node-name or $NODE_NAME"
            )
        if not self.simulate:
            self.simulate = None
        return self


class AgentFields(NodeFields):
    """The agent's keys and their checks: `AgentSettings` validates them alone, and
    `Config` (the whole file) adds the other programs' sections to them."""

    schedules: Schedules = Schedules()
    labels: LabelsConfig = LabelsConfig()
    metrics: MetricsConfig = MetricsConfig()
    influxdb: InfluxConfig = InfluxConfig()
    kubernetes: KubernetesConfig = KubernetesConfig()
    health: HealthConfig = HealthConfig()
    dra: DraConfig = DraConfig()
    remediation: RemediationConfig = RemediationConfig()
    logging: LoggingConfig = LoggingConfig.model_validate({})

    @model_validator(mode="after")
    def _history(self) -> Self:
        history_defaults(self.influxdb, self.schedules)
        return self

    def influx_token(self) -> str:
        """The token from the environment or token_file (read now); never logged."""
        return influx_token(self.influxdb)
