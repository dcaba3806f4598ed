"""Configuration: YAML file, then GPUDAEMON_* environment variables, then CLI flags.

Validated once at load by pydantic; any problem becomes one ConfigError line that
names the key. Each field's comment says why its default is what it is.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import socket
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit, urlunsplit

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import EnvSettingsSource, SettingsError
from pydantic_settings.sources.utils import parse_env_vars

from gpudaemon.errors import ConfigError, CronError, UsageError
from gpudaemon.incluster import SA_TOKEN
from gpudaemon.labels.sanitize import DEFAULT_PREFIX, validate_prefix
from gpudaemon.schedule import CRON_PATTERN, parse_cron
from gpudaemon.selector import SELECTOR_PATTERN, check_selector
from gpudaemon.textfile import MIB, check_regular_file, read_text_file

ENV_PREFIX = "GPUDAEMON_"
# Where history waits while InfluxDB is down (a hostPath or emptyDir in the chart).
DEFAULT_SPOOL_DIR = "/var/lib/gpudaemon/spool"
DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


DNS1123_SUBDOMAIN_PATTERN = f"^{DNS1123_SUBDOMAIN.pattern}$"
DNS1123_LABEL_PATTERN = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


def _check_dns_subdomain(v: str) -> str:
    if not DNS1123_SUBDOMAIN.fullmatch(v) or len(v) > 253:
        raise ValueError(f"{v!r} is not a DNS-1123 subdomain (lower-case a-z, 0-9, '-', '.')")
    return v


def _check_dns_label(v: str) -> str:
    if not re.fullmatch(DNS1123_LABEL_PATTERN[1:-1], v) or len(v) > 63:
        raise ValueError(f"{v!r} is not a namespace name (a DNS-1123 label: a-z, 0-9, '-')")
    return v


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", coerce_numbers_to_str=True)


def _check_listen(v: str) -> str:
    from gpudaemon.httpserver import parse_listen  # the one parser, shared with the server

    try:
        parse_listen(v, "listen")
    except UsageError as e:
        raise ValueError(str(e).removeprefix("listen: ")) from None
    return v


def _not_bool(v: Any) -> Any:
    # YAML `true` is not a count; "50" from an environment variable is.
    if isinstance(v, bool):
        raise ValueError("expected a whole number, got a boolean")
    return v


def _not_bool_number(v: Any) -> Any:
    if isinstance(v, bool):
        raise ValueError("expected a number, got a boolean")
    return v


def _not_number(v: Any) -> Any:
    # YAML `1` is not a switch; "true" from an environment variable is.
    if isinstance(v, int | float) and not isinstance(v, bool):
        raise ValueError("expected true or false, got a number")
    return v


def _check_labels_to(v: str) -> str:
    """A word, or a file path; a typo of a word ("apiservr") must not become a file."""
    if v in LABEL_OUTPUTS or "/" in v:
        return v
    raise ValueError(
        f"{v!r} is not one of {', '.join(LABEL_OUTPUTS)}, nor a file path "
        "(a path contains '/': ./labels.json, /var/run/labels.json)"
    )


_HOST = re.compile(
    r"(?:[A-Za-z0-9](?:[-A-Za-z0-9]{0,61}[A-Za-z0-9])?)(?:\.[A-Za-z0-9](?:[-A-Za-z0-9]{0,61}[A-Za-z0-9])?)*\.?"
)


def redact_url(url: str) -> str:
    """`url` without its user and password (http://user:pw@host -> http://***@host):
    the only form of a URL that may appear in a message or a log line."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2]))


def _check_influx_url(url: str) -> str:
    """Empty (history off) or http(s)://host[:port][/path]: anything else would fail on
    every write at run time while the agent looked healthy. Messages show the URL
    without credentials."""
    if not url:
        return url
    v = redact_url(url)
    try:
        u = urlsplit(url)
        port = u.port  # ValueError when not a number in 0..65535
    except ValueError as e:
        raise ValueError(f"{v!r}: {e}") from None
    if u.scheme not in ("http", "https"):
        raise ValueError(f"{v!r}: the scheme must be http:// or https://")
    host = u.hostname or ""
    if u.netloc.startswith("[") or ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{v!r}: {host!r} is not a valid IPv6 address") from None
    elif not host or len(host) > 253 or not _HOST.fullmatch(host):
        raise ValueError(f"{v!r}: {host!r} is not a valid host name or address")
    if port == 0 or (u.netloc.endswith(":") and port is None):
        raise ValueError(f"{v!r}: the port must be 1..65535")
    if u.query or u.fragment:
        raise ValueError(f"{v!r}: no query or fragment (the agent adds /api/v2/write?...)")
    return url


# "host:port", "[v6]:port" or ":port": the one listen-address type (agent and extender).
ListenAddress = Annotated[str, AfterValidator(_check_listen)]
# A whole number: 50 or "50" (environment variables are strings), not 1.5 or true.
WholeNumber = Annotated[int, BeforeValidator(_not_bool)]
# A finite number: 2.5 or "2.5", not true, .inf or .nan. Every one also has bounds
# below, so nothing accepted here can overflow where it is used (a 1e12 s timeout did).
Number = Annotated[float, BeforeValidator(_not_bool_number), Field(allow_inf_nan=False)]
# A switch: true/false (or "true" from the environment), not 1 or 0.
Switch = Annotated[bool, BeforeValidator(_not_number)]
LABEL_OUTPUTS = ("apiserver", "stdout", "nfd", "none")


# The cron form in the JSON schema too (the Helm chart's values schema): `helm install`
# refuses what the agent would (schedule.py: check_cron_form; the range order is the
# chart template's check).
Cron = Annotated[str, Field(json_schema_extra={"pattern": CRON_PATTERN})]
CronOrNone = Annotated[
    str, Field(json_schema_extra={"pattern": "^(?:none|" + CRON_PATTERN[1:-1] + ")$"})
]


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


class LabelsConfig(_Section):
    prefix: str = DEFAULT_PREFIX
    # apiserver | stdout | nfd | none | a file path. With no Kubernetes credentials,
    # "apiserver" falls back to stdout so a laptop run still shows the labels.
    to: Annotated[str, Field(min_length=1), AfterValidator(_check_labels_to)] = "apiserver"
    # NFD's local source reads feature files from here (mounted from the host).
    nfd_path: str = "/etc/kubernetes/node-feature-discovery/features.d/gpudaemon"
    # Taint the Node `<prefix>gpu-unhealthy:NoSchedule` while any GPU is unhealthy. Off:
    # a taint also keeps CPU-only pods off a node with seven good GPUs, which is the
    # operator's call; the `gpu.unhealthy` label and `GPUHealthy` condition are always on.
    taint_unhealthy: Switch = False
    # The NVIDIA device plugin's MIG strategy on this node, which decides what MIG
    # labels mean (GFD's rules): none (MIG devices not advertised), single (every MIG
    # device is an nvidia.com/gpu and gpu.* describe them), mixed (nvidia.com/mig-<p>
    # per profile, with mig-<p>.* labels). Set it to the device plugin's.
    mig_strategy: Literal["none", "single", "mixed"] = "none"

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        return validate_prefix(v)


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


class KubernetesConfig(_Section):
    # Empty: in a cluster, its service account; else the first file in $KUBECONFIG
    # that exists, then ~/.kube/config (resolved when the config is loaded).
    kubeconfig: str = ""
    # None: in a cluster when $KUBERNETES_SERVICE_HOST is set and the service-account
    # token is mounted (resolved when the config is loaded).
    in_cluster: Switch | None = None
    # Who this process is in Leases: the agent's node Lease holder is `<this>/<pid>`.
    # Empty: $POD_NAME, then the hostname (resolved when the config is loaded).
    holder_identity: str = ""
    # The rebalancer's identity in its leader Lease. Empty: holder_identity when that
    # was set explicitly, else `<$POD_NAME or hostname>_<random UUID>`, as client-go
    # makes it: two replicas on one hostname (no $POD_NAME) must never both lead.
    leader_identity: str = ""
    # Stale after this; renewed every third of it (`kube.lease.renew_period_s`). 6 min
    # gives 30 Lease writes per node-hour (kubelet's own node lease costs 360) and a
    # stale threshold the extender can live with: GPU data needs no liveness precision.
    lease_duration_seconds: Annotated[WholeNumber, Field(ge=10, le=86400)] = 360
    # The namespace of the agents' node Leases and the rebalancer's leader Lease (the
    # chart sets its release namespace). `gpudaemon status` uses it when it is set here
    # or in the environment; otherwise it finds the agents' Leases by their label.
    lease_namespace: str = "gpudaemon"
    # Backoff cap after API errors: bounds recovery time without hammering a sick server.
    backoff_max_seconds: Annotated[Number, Field(gt=0, le=3600)] = 60.0
    # Per-request read timeout: a hung API server must never hold a job for long.
    request_timeout_seconds: Annotated[Number, Field(gt=0, le=600)] = 10.0
    # Connect timeout: a dead server refuses at once; a black-holed one should not
    # hold a job for long.
    connect_timeout_seconds: Annotated[Number, Field(gt=0, le=600)] = 3.0
    # Re-read the Node this often to repair drift (someone removed our label);
    # a read, not a write, so it costs the API server little.
    resync_seconds: Annotated[Number, Field(gt=0, le=7 * 86400)] = 600.0


class TypicalPod(_Section):
    """One typical pod shape for the fragmentation policy (an override of the shapes it
    learns from the pods it sees)."""

    gpus: Annotated[WholeNumber, Field(ge=1, le=1024)]
    cpu_milli: Annotated[WholeNumber, Field(ge=0, le=10**7)] = 0
    memory_mib: Annotated[WholeNumber, Field(ge=0, le=10**9)] = 0
    gpu_models: list[str] = []
    weight: Annotated[Number, Field(gt=0, le=1e6)] = 1.0


class ExtenderTls(_Section):
    # All three or none. Set: the extender serves HTTPS and refuses, at the handshake,
    # any client without a certificate signed by client_ca_file (kube-scheduler's
    # extender tlsConfig presents one). For the Service mode; see docs/security.md.
    cert_file: str = ""
    key_file: str = ""
    client_ca_file: str = ""

    @model_validator(mode="after")
    def _all_or_none(self) -> ExtenderTls:
        given = [bool(self.cert_file), bool(self.key_file), bool(self.client_ca_file)]
        if any(given) and not all(given):
            raise ValueError("set cert_file, key_file and client_ca_file together (mutual TLS)")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file)


class ExtenderConfig(_Section):
    # The chart's default runs the extender beside kube-scheduler in its pod, on
    # 127.0.0.1: nobody else can reach it. 0.0.0.0 only with tls (Service mode).
    listen: ListenAddress = "0.0.0.0:9446"
    # /metrics, /healthz and /readyz on a second, plain-HTTP address (never the
    # scheduler verbs), for kubelet probes and Prometheus when `listen` is loopback
    # or mutual TLS. Empty: only on `listen`.
    metrics_listen: Annotated[str, AfterValidator(lambda v: _check_listen(v) if v else v)] = ""
    tls: ExtenderTls = ExtenderTls()
    # The default policy; a pod picks another with the annotation gpudaemon.io/policy.
    # fragmentation: fewest unallocated GPUs on the openb trace (docs/benchmarks.md).
    # Checked against the policy registry (cluster/policies/) when the extender starts:
    # configuration sits below the extender and does not import it.
    policy: Annotated[str, Field(min_length=1, max_length=63)] = "fragmentation"
    # Weight of measured utilization as the tie-break within a policy. Below 1, so it
    # only orders nodes the GPU arithmetic leaves equal.
    utilization_weight: Annotated[Number, Field(ge=0, lt=1)] = 0.5
    # A node with a lost or XID-failed GPU takes no new GPU pods: it will likely be
    # drained and rebooted, and a pod landing there now would be killed with it.
    avoid_unhealthy_nodes: Switch = True
    # How long a pod ranked best for a node is counted there before its binding shows
    # up in the watch. Longer than any bind; short enough that a pod that went elsewhere
    # unseen does not hide capacity for long.
    assume_ttl_seconds: Annotated[Number, Field(ge=1, le=600)] = 30.0
    # The same for a gang's pod (label scheduling.x-k8s.io/pod-group): it waits at
    # Coscheduling's Permit, unbound, until the whole gang has nodes, up to the
    # PodGroup's scheduleTimeoutSeconds. Keep this above that timeout. A pod the
    # scheduler tries again stops being counted at once, so a long value costs nothing.
    gang_assume_ttl_seconds: Annotated[Number, Field(ge=1, le=3600)] = 600.0
    # How many of the policy's best nodes /filter passes on (0: every node that fits).
    # 1 is HAMi's style: the pick alone, no /prioritize call, in-tree scores have no say.
    # More: the scheduler's own preferences choose among that many of the best nodes.
    candidates: Annotated[WholeNumber, Field(ge=0, le=100_000)] = 10
    # Requests larger than this are refused with 413, from their Content-Length, before
    # the body is read. The chart's scheduler sends node names (nodeCacheCapable): 5,000
    # nodes are 0.06 MiB. Without nodeCacheCapable each Node object is ~12 KiB, so
    # 32 MiB admits ~2,600 nodes: turn nodeCacheCapable on for more (docs/scheduler.md).
    max_body_bytes: Annotated[WholeNumber, Field(ge=1024, le=1 << 30)] = 32 << 20
    # Request-body bytes held at once, across all connections (503 past it). Each body
    # byte costs up to ~6 bytes of RSS while it is parsed (bench/bodies), so 48 MiB of
    # bodies peak near 300 MiB above a ~100 MiB baseline: inside the chart's 512 Mi
    # limit. Raise it only with the memory limit (docs/operations.md).
    body_budget_bytes: Annotated[WholeNumber, Field(ge=1024, le=1 << 32)] = 48 << 20
    # A request must arrive whole (TLS handshake, headers, body) within this of its
    # first byte or of the connection opening: kube-scheduler sends at once; a client
    # that trickles its headers is closed rather than holding a connection slot.
    read_timeout_seconds: Annotated[Number, Field(ge=1, le=300)] = 10.0
    # A connection idle between requests is closed after this. Above the 90 s after
    # which kube-scheduler's Go client drops its own idle connections, so the server
    # never closes one under a request the scheduler is sending.
    idle_timeout_seconds: Annotated[Number, Field(ge=1, le=3600)] = 120.0
    # Worker threads for requests: the scheduler sends one request at a time per
    # scheduler; a few more absorb retries and scrapes.
    threads: Annotated[WholeNumber, Field(ge=1, le=256)] = 8
    # Open connections at once and request header bytes (over it: 431): kube-scheduler
    # keeps a few connections with small headers. At the limit the stalest connection
    # that is not being served (one that never finished a request first) makes room.
    max_connections: Annotated[WholeNumber, Field(ge=1, le=100_000)] = 256
    max_header_bytes: Annotated[WholeNumber, Field(ge=1024, le=1 << 20)] = 32 << 10
    # Pods remembered for learning the workload's typical shapes (fragmentation policy).
    # The kube-scheduler profile that calls us: placements are booked only for real,
    # unbound pods that name it (never on a request body's word).
    scheduler_name: Annotated[str, Field(min_length=1, max_length=253)] = "gpudaemon-scheduler"
    # A pod the watch has not delivered yet is checked in the API; this caps those
    # GETs, so a flood of invented pod UIDs cannot turn into API server load.
    pod_lookups_per_second: Annotated[Number, Field(gt=0, le=1000)] = 20.0
    workload_window: Annotated[WholeNumber, Field(ge=1, le=1_000_000)] = 2000
    typical_pods: list[TypicalPod] = []

    @model_validator(mode="after")
    def _budget_holds_one_body(self) -> ExtenderConfig:
        if self.body_budget_bytes < self.max_body_bytes:
            raise ValueError(
                f"body_budget_bytes ({self.body_budget_bytes}) must be at least"
                f" max_body_bytes ({self.max_body_bytes}): a body at the cap must fit"
            )
        return self


class RebalanceConfig(_Section):
    """`gpudaemon rebalance`: drain pods off unhealthy GPUs, defragment for pending
    pods. Acts only with --apply (or dry_run: false); otherwise logs and emits Events."""

    dry_run: Switch = True
    listen: ListenAddress = "0.0.0.0:9447"
    # One pass every interval: drain, then defragment.
    interval_s: Annotated[Number, Field(ge=1, le=3600)] = 30.0
    # A GPU unhealthy for less than this is left alone (a transient the agent clears,
    # or a node about to be drained anyway).
    grace_s: Annotated[Number, Field(ge=0, le=86400)] = 300.0
    # Caps over any 60 s and per node per 60 s. A defragmentation plan that does not fit
    # in what is left is not started at all.
    max_evictions_per_minute: Annotated[WholeNumber, Field(ge=1, le=10_000)] = 10
    max_evictions_per_node: Annotated[WholeNumber, Field(ge=1, le=1000)] = 8
    # Leader election: the Lease `gpudaemon-rebalancer` in kubernetes.lease_namespace,
    # held by kubernetes.leader_identity; the leader renews it every third of this.
    lease_duration_s: Annotated[WholeNumber, Field(ge=5, le=3600)] = 15
    # Pods that may be moved to defragment: the annotation gpudaemon.io/rebalance="true",
    # or matching this label selector (empty: the annotation only). Draining a sick GPU
    # needs no opt-in: the pod is already on a broken device.
    selector: Annotated[
        str,
        AfterValidator(check_selector),
        Field(json_schema_extra={"pattern": SELECTOR_PATTERN}),
    ] = ""
    # How long the room made for a pending pod is kept for it: the extender turns away
    # other pods of no higher priority from that node (the evicted pods' replacements
    # first) until the pod is bound, deleted, or this runs out, or the rebalancer loses
    # its Lease. Capped at 10 minutes: a reservation holds GPUs nobody uses.
    reserve_s: Annotated[Number, Field(ge=10, le=600)] = 300.0
    # Reservations live at once (kept on the leader Lease); a plan that would need one
    # more waits until one is released. Bounds what the rebalancer can hold idle.
    max_reservations: Annotated[WholeNumber, Field(ge=1, le=256)] = 16
    # Pods of this scheduler are the ones defragmentation makes room for (the pending
    # watch selects them by spec.schedulerName; a DNS-1123 subdomain, as the API has it).
    scheduler_name: Annotated[
        str,
        AfterValidator(_check_dns_subdomain),
        Field(max_length=253, json_schema_extra={"pattern": DNS1123_SUBDOMAIN_PATTERN}),
    ] = "gpudaemon-scheduler"
    # Namespaces whose pending pods defragmentation makes room for; empty: every
    # namespace. A pod elsewhere gets no evictions and no Event (counted in
    # gpudaemon_rebalancer_skipped{reason="namespace"}). Opted-in pods may still be
    # moved from any namespace.
    namespaces: list[
        Annotated[
            str,
            AfterValidator(_check_dns_label),
            Field(max_length=63, json_schema_extra={"pattern": DNS1123_LABEL_PATTERN}),
        ]
    ] = []


class HealthConfig(_Section):
    # Where a critical XID or uncorrected ECC fault is remembered across agent restarts
    # until the node reboots (a new boot ID). "auto": /var/lib/gpudaemon/health.json
    # with real NVML, nothing with simulated GPUs (a laptop demo writes no state);
    # "" turns it off. The chart mounts /var/lib/gpudaemon from the host.
    state_file: str = "auto"


class LoggingConfig(_Section):
    level: Literal["TRACE", "DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    json_: Switch = Field(False, alias="json")

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @field_validator("level", mode="before")
    @classmethod
    def _upper(cls, v: Any) -> Any:
        return v.upper() if isinstance(v, str) else v


class Config(_Section):
    # Empty: $NODE_NAME, then the lower-cased hostname, as kubelet names the Node
    # (resolved when the config is loaded).
    node_name: str = ""
    simulate: str | None = None  # absent: real NVML
    simulate_seed: Annotated[WholeNumber, Field(ge=0, le=2**64 - 1)] | None = None
    schedules: Schedules = Schedules()
    labels: LabelsConfig = LabelsConfig()
    metrics: MetricsConfig = MetricsConfig()
    influxdb: InfluxConfig = InfluxConfig()
    kubernetes: KubernetesConfig = KubernetesConfig()
    extender: ExtenderConfig = ExtenderConfig()
    rebalance: RebalanceConfig = RebalanceConfig()
    health: HealthConfig = HealthConfig()
    logging: LoggingConfig = LoggingConfig.model_validate({})

    @model_validator(mode="after")
    def _defaults(self, info: ValidationInfo) -> Config:
        # It goes into API paths: only a valid Node name (DNS-1123 subdomain) may. The
        # extender, the rebalancer and `status` never use it: a hostname that is no
        # Node name (an underscore, say) must not stop them.
        used = (info.context or {}).get("node_name_used", True)
        if used and (len(self.node_name) > 253 or not DNS1123_SUBDOMAIN.fullmatch(self.node_name)):
            raise ValueError(
                f"node_name {self.node_name!r} is not a valid Node name "
                "(lower-case letters, digits, '-' and '.', at most 253 characters); "
                "set it with --node-name or $NODE_NAME"
            )
        if not self.simulate:
            self.simulate = None
        return self

    @model_validator(mode="after")
    def _history_timeout(self) -> Config:
        if self.influxdb.url:
            if not self.influxdb.spool_dir:
                self.influxdb.spool_dir = DEFAULT_SPOOL_DIR
            check_history_timeout(self.influxdb.timeout_ms, self.schedules.history)
            if self.influxdb.token_file and not self.influxdb.token.get_secret_value():
                try:  # a FIFO, /dev/zero or a missing file: now, in one line
                    self.influx_token()
                except UsageError as e:
                    raise ValueError(str(e)) from None
        return self

    @model_validator(mode="after")
    def _kubeconfig_is_a_file(self) -> Config:
        # The kubernetes library opens it later; /dev/zero or a FIFO would hang there.
        # (A missing one is reported when the API server sink starts, as before.)
        if self.kubernetes.kubeconfig and os.path.exists(self.kubernetes.kubeconfig):
            try:
                check_regular_file(self.kubernetes.kubeconfig, "kubernetes.kubeconfig", 16 * MIB)
            except UsageError as e:
                raise ValueError(str(e)) from None
        return self

    def influx_token(self) -> str:
        """The token from the environment or token_file; never logged."""
        if self.influxdb.token.get_secret_value():
            return self.influxdb.token.get_secret_value()
        if self.influxdb.token_file:
            path = self.influxdb.token_file
            return read_text_file(path, "influxdb.token_file", 64 * 1024, ConfigError).strip()
        return ""


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


class _EnvSource(EnvSettingsSource):
    """pydantic-settings' GPUDAEMON_* reader (nested keys joined by `__`, JSON for
    lists), over an injected mapping instead of the process environment."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self._environ = environ
        super().__init__(
            Config,  # type: ignore[arg-type]  # a plain model works: only its fields are read
            case_sensitive=False,
            env_prefix=ENV_PREFIX,
            env_nested_delimiter="__",
        )

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return parse_env_vars(self._environ, False, False, None)


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """GPUDAEMON_INFLUXDB__URL=x -> {"influxdb": {"url": "x"}}.

    Variables whose first part is not a config key (GPUDAEMON_TOOLS_DIR, say) belong
    to someone else and are ignored; a typo inside a known section is an error.
    """
    try:
        return _EnvSource(environ)()
    except SettingsError as e:  # e.g. a section or list set to something not JSON
        m = re.search(r'field "(\w+)"', str(e))
        name = f"{ENV_PREFIX}{m.group(1).upper()}" if m else ENV_PREFIX + "*"
        cause = " ".join(str(e.__cause__ or e).split())[:200]
        raise ConfigError(
            f"environment {name}: not a valid value for a section or list "
            f"(set one key with {name}__KEY, or give JSON): {cause}"
        ) from None


# Once per process: every load of the config in one process names the same leader, and
# two processes (two replicas, or one restarted) never the same.
PROCESS_UUID = str(uuid.uuid4())


def _from_environment(data: dict[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """The defaults that come from the environment; every such read is here."""
    out = dict(data)
    if not out.get("node_name"):
        out["node_name"] = environ.get("NODE_NAME") or socket.gethostname().lower()
    kube = out.get("kubernetes")
    if kube is not None and not isinstance(kube, Mapping):
        return out  # not a section: validation names it
    k: dict[str, Any] = dict(kube or {})
    if k.get("in_cluster") is None:
        k["in_cluster"] = bool(environ.get("KUBERNETES_SERVICE_HOST")) and SA_TOKEN.is_file()
    if not k.get("kubeconfig") and k["in_cluster"] is not True:
        home = environ.get("HOME")
        candidates = [*environ.get("KUBECONFIG", "").split(os.pathsep)]
        candidates += [f"{home}/.kube/config"] if home else []
        k["kubeconfig"] = next((c for c in candidates if c and Path(c).is_file()), "")
    # Not a string: left as it is, for validation to name it.
    raw = k.get("holder_identity")
    explicit = raw.strip() if isinstance(raw, str) else raw
    k["holder_identity"] = explicit or environ.get("POD_NAME") or socket.gethostname()
    lead = k.get("leader_identity")
    if not (lead.strip() if isinstance(lead, str) else lead):
        k["leader_identity"] = explicit or f"{k['holder_identity']}_{PROCESS_UUID}"
    out["kubernetes"] = k
    return out


def _deep_merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def load_config(
    path: str | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    *,
    node_name_used: bool = True,
) -> Config:
    """The configuration from `path`, the environment and `overrides`, validated.
    `node_name_used=False` for programs that do not run on a GPU node."""
    data: dict[str, Any] = {}
    if path:
        # Only a regular file, at most 1 MiB: /dev/zero, a FIFO or /dev/stdin on a pipe
        # or terminal are one line and exit 2, not a hang or a MemoryError.
        text = read_text_file(path, "config file", MIB, ConfigError)
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(
                f"config file {path}: invalid YAML: {' '.join(str(e).split())}"
            ) from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path}: expected a mapping at the top level")
        data = loaded or {}
    env = os.environ if environ is None else environ
    data = _deep_merge(data, env_overrides(env))
    data = _deep_merge(data, overrides or {})
    data = _from_environment(data, env)
    try:
        return Config.model_validate(data, context={"node_name_used": node_name_used})
    except ValidationError as e:
        raise ConfigError(_describe(e, path)) from None


def _describe(e: ValidationError, path: str | None) -> str:
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = "unknown key"
    where = f"config {path}" if path else "config"
    extra = f" (and {len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
    return f"{where}: {loc + ': ' if loc else ''}{msg}{extra}"
