"""The rebalancer's own series: evictions and skips by kind and reason, the blocked-pod
gauge its alert watches, leadership, dry-run and pass timing. Every label pair is
created at start, so a rate() over a reason that has not happened yet reads 0, not
nothing."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gpudaemon.rebalancer.drain import DRAIN_ACTIONS
from gpudaemon.rebalancer.planner import Decision
from gpudaemon.rebalancer.resets import RESULTS as RESET_RESULTS

RESULTS = ("planned", "done", "refused_pdb", "failed")
SKIPS = ("bare_pod", "stale", "rate_limited", "refused_pdb", "api_error", "max_reservations")
# Why no room is made for a pending pod at all (kind "defrag" only).
DEFRAG_SKIPS = ("never_fits", "cannot_judge", "unknown_policy", "namespace", "scheduler", "backoff")


class RebalancerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.evictions = Counter(
            "gpudaemon_rebalancer_evictions",
            "Evictions by kind (drain, defrag) and result: planned (dry-run: what it would "
            "do), done, refused_pdb (a PodDisruptionBudget said no; retried later), failed.",
            ["kind", "result"],
            registry=registry,
        )
        self.skipped = Counter(
            "gpudaemon_rebalancer_skipped",
            "Pods or plans left alone, by kind and reason: bare_pod (no controller would "
            "re-create it), stale (agent data too old), rate_limited, refused_pdb (a plan "
            "one of whose victims a PodDisruptionBudget protects), api_error, max_reservations "
            "(as many rooms kept as rebalance.max_reservations allows); defrag only, "
            "counted with each Event (per pod at most every 10 min): never_fits (no node "
            "could run it even emptied), "
            "cannot_judge (its placement depends on what the caches cannot tell), "
            "unknown_policy (its gpudaemon.io/policy annotation names no registered "
            "policy: the extender places it on no node), "
            "namespace (not in rebalance.namespaces), scheduler (another scheduler's pod), "
            "backoff (its room was made and it still did not schedule).",
            ["kind", "reason"],
            registry=registry,
        )
        self.drains = Counter(
            "gpudaemon_rebalancer_drain_evictions",
            "Drain evictions by the GPU's action (drain, reset_gpu, reboot_node, replace) "
            "and result (as gpudaemon_rebalancer_evictions_total's).",
            ["action", "result"],
            registry=registry,
        )
        self.blocked = Gauge(
            "gpudaemon_rebalancer_blocked_pods",
            "Pods the last pass wanted to evict but could not (PDB, rate limit, bare pod, "
            "stale data): what the GpudaemonRebalancerBlocked alert watches.",
            registry=registry,
        )
        self.leader = Gauge(
            "gpudaemon_rebalancer_leader",
            "1 while this replica holds the Lease.",
            registry=registry,
        )
        self.dry_run = Gauge(
            "gpudaemon_rebalancer_dry_run",
            "1 when it only logs and emits Events.",
            registry=registry,
        )
        self.resets = Counter(
            "gpudaemon_rebalancer_resets",
            "GPU reset grants (remediation.reset_gpu) by result: granted, planned (dry "
            "run), expired (the agent did not answer within remediation.grant_ttl_s), "
            "failed (the Node write failed); a GPU ready for a reset but held back, "
            "counted at most every 10 min per GPU: concurrency (remediation.max_concurrent), "
            "breaker_open, window_closed.",
            ["result"],
            registry=registry,
        )
        self.reset_breaker_open = Gauge(
            "gpudaemon_rebalancer_reset_breaker_open",
            "1 while GPU resets are held back because more than "
            "remediation.max_unhealthy_fraction of the fleet's GPUs turned unhealthy within "
            "remediation.window_s.",
            registry=registry,
        )
        self.passes = Counter(
            "gpudaemon_rebalancer_passes", "Passes run while leading.", registry=registry
        )
        self.pass_seconds = Histogram(
            "gpudaemon_rebalancer_pass_duration_seconds",
            "Time one pass takes (planning and the API calls it makes); the pass "
            "interval must stay well above it.",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=registry,
        )
        for kind in ("drain", "defrag"):
            for r in RESULTS:
                self.evictions.labels(kind, r)
            for s in SKIPS:
                self.skipped.labels(kind, s)
        for s in DEFRAG_SKIPS:
            self.skipped.labels("defrag", s)
        for a in DRAIN_ACTIONS:
            for r in RESULTS:
                self.drains.labels(a, r)
        for r in RESET_RESULTS:
            self.resets.labels(r)

    def evicted(self, d: Decision, result: str) -> None:
        self.evictions.labels(d.kind, result).inc()
        if d.action:
            self.drains.labels(d.action, result).inc()
