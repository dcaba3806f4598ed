"""The extender's section (`extender`, its TLS and typical pods); `ExtenderSettings`,
the model `gpudaemon extender` validates, is in programs.py."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, model_validator

from gpudaemon.config.values import (
    ListenAddress,
    Number,
    Switch,
    WholeNumber,
    _check_listen,
    _Section,
)


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


PluginName = Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]{0,62}$")]


class ScorePluginConfig(_Section):
    name: PluginName
    # The plug-in's share of the sum: its scores are normalised to 0..100 on the
    # request's nodes, then multiplied by this (kube-scheduler's rule).
    weight: Annotated[WholeNumber, Field(ge=1, le=100)] = 1

    @model_validator(mode="before")
    @classmethod
    def _bare_name(cls, v: Any) -> Any:
        return {"name": v} if isinstance(v, str) else v  # `- binpack`: weight 1


class PluginsConfig(_Section):
    """The extender's plug-ins by name, in order (cluster/plugins/), which the
    rebalancer also runs to foresee placements. Checked against the plug-in registry
    when the extender and the rebalancer start, as `policy` is. The defaults are
    the extender's behaviour before plug-ins existed."""

    # Run in order per node; the first that fails names the node's reason.
    filter: list[PluginName] = ["fresh", "healthy", "gpu_fit", "reserved"]
    # `policy`: each pod's own policy (annotation, MIG, `policy` above); a policy's
    # name: that policy for every pod; or any registered score plug-in.
    score: Annotated[list[ScorePluginConfig], Field(min_length=1)] = [
        ScorePluginConfig(name="policy")
    ]
    # Score plug-ins compared in order before the weighted sum (an ordered comparison,
    # not a number: no weight outvotes them): free GPUs that are not degraded first,
    # then a gang pod's tiers.
    tiers: list[PluginName] = ["healthy_gpus", "gang"]
    # Run for the node ranked first (assume: count the pod there until it is bound).
    reserve: list[PluginName] = ["assume"]
    # Each plug-in's own arguments, by plug-in name (checked against the plug-in when
    # the extender starts). Over the older keys: `healthy.enabled` defaults to
    # `avoid_unhealthy_nodes`, `healthy_gpus.enabled` to `prefer_healthy_gpus`.
    args: dict[PluginName, dict[str, Any]] = {}

    @model_validator(mode="after")
    def _no_repeats(self) -> PluginsConfig:
        for kind, names in (
            ("filter", self.filter),
            ("score", [s.name for s in self.score]),
            ("tiers", self.tiers),
            ("reserve", self.reserve),
        ):
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:
                raise ValueError(f"{kind}: {', '.join(twice)} named more than once")
        return self


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
    # fragmentation-model: FGD per GPU model; with no pod pinned to a model it orders
    # nodes exactly as fragmentation does, and with pinned pods it strands far fewer
    # GPUs (docs/benchmarks.md, openb with --pin). Checked against the policy registry
    # (cluster/policies/) when the extender starts: configuration sits below the
    # extender and does not import it.
    policy: Annotated[str, Field(min_length=1, max_length=63)] = "fragmentation-model"
    # Weight of measured utilization as the tie-break within a policy. Below 1, so it
    # only orders nodes the GPU arithmetic leaves equal.
    utilization_weight: Annotated[Number, Field(ge=0, lt=1)] = 0.5
    # A node with a lost or XID-failed GPU takes no new GPU pods: it will likely be
    # drained and rebooted, and a pod landing there now would be killed with it.
    avoid_unhealthy_nodes: Switch = True
    # A node that can give a new pod enough free GPUs that are not degraded (the agent's
    # verdict: clock slowdowns, growing remaps, NVLink errors) ranks above one that
    # would have to use a degraded GPU, before any policy or plug-in order.
    prefer_healthy_gpus: Switch = True
    # A pod asking for no GPU, which reaches the extender because the chart's profile
    # sends it every pod. full_nodes_first: the nodes where its CPU and memory can
    # strand no GPU (every GPU taken, or none at all) score 10, the others 0, and
    # kube-scheduler draws at random within each (docs/scheduler.md, "Pods asking for
    # no GPU"). random: every node scores 0. policy: a policy that judges such pods
    # (fragmentation: where their CPU and memory strand fewest GPUs) ranks them.
    # Compared on the openb trace in docs/benchmarks.md.
    gpuless_pods: Literal["full_nodes_first", "random", "policy"] = "full_nodes_first"
    # How long a pod ranked best for a node is counted there before its binding shows
    # up in the watch. Longer than any bind; short enough that a pod that went elsewhere
    # unseen does not hide capacity for long.
    assume_ttl_seconds: Annotated[Number, Field(ge=1, le=600)] = 30.0
    # The same for a gang's pod (label scheduling.x-k8s.io/pod-group): it waits at
    # Coscheduling's Permit, unbound, until the whole gang has nodes, up to the
    # PodGroup's scheduleTimeoutSeconds. Keep this above that timeout. A pod the
    # scheduler tries again stops being counted at once, so a long value costs nothing.
    # A native PodGroup's pod (spec.schedulingGroup) gets assume_ttl_seconds: it is
    # placed in one group cycle and never waits at Permit.
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
    # Filter, score and reserve plug-ins, by name and in order (docs/scheduler.md).
    plugins: PluginsConfig = PluginsConfig()

    @model_validator(mode="after")
    def _budget_holds_one_body(self) -> ExtenderConfig:
        if self.body_budget_bytes < self.max_body_bytes:
            raise ValueError(
                f"body_budget_bytes ({self.body_budget_bytes}) must be at least"
                f" max_body_bytes ({self.max_body_bytes}): a body at the cap must fit"
            )
        return self
