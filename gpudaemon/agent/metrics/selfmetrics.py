"""The agent's own metrics: how its polls, writes and sinks are doing."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from gpudaemon import __version__

# `*_created` series double the counter/histogram output and no dashboard or alert
# reads them; process-wide, like prometheus-client's own switch.
disable_created_metrics()  # type: ignore[no-untyped-call]

# Poll latencies run from ~50 us (simulated) to seconds (a sick driver).
_POLL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class AgentMetrics:
    """The agent's self-metrics, registered on the registry the app serves.

    The scheduled job is the `task` label, not `job`: Prometheus owns `job` (the
    scrape job) and would rename ours to `exported_job`.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.poll_duration_seconds = Histogram(
            "gpudaemon_poll_duration_seconds",
            "Time one scheduled job took, by job.",
            ["task"],
            registry=registry,
            buckets=_POLL_BUCKETS,
        )
        self.poll_cpu_seconds = Counter(
            "gpudaemon_poll_cpu_seconds",
            "CPU time the job's thread spent in its runs, by job (beside the wall time of "
            "gpudaemon_poll_duration_seconds: waiting is the difference).",
            ["task"],
            registry=registry,
        )
        self.poll_errors = Counter(
            "gpudaemon_poll_errors",
            "Scheduled job runs that failed, by job.",
            ["task"],
            registry=registry,
        )
        self.job_overruns = Counter(
            "gpudaemon_job_overruns",
            "Runs skipped because the previous run of the job was still going.",
            ["task"],
            registry=registry,
        )
        self.quarantine_seconds = Histogram(
            "gpudaemon_quarantine_seconds",
            "From a GPU turning unhealthy (the XID event, or the poll that found it) to "
            "the end of the out-of-turn reconcile that wrote it to the Node, by trigger.",
            ["trigger"],
            registry=registry,
            buckets=_POLL_BUCKETS,
        )
        # GPU resets (remediation.reset_gpu): bounded by the node's GPUs x 4 results.
        self.gpu_resets = Counter(
            "gpudaemon_gpu_resets",
            "GPU resets the rebalancer granted, by GPU and result: success (healthy for "
            "remediation.settle_s after it), failed (the tool failed, or the fault came "
            "back), skipped_busy (a pod or process held the GPU), blocked (not resettable "
            "now: lost, not alone, attempts spent).",
            ["gpu", "uuid", "result"],
            registry=registry,
        )
        self.gpu_reset_seconds = Histogram(
            "gpudaemon_gpu_reset_seconds",
            "From the start of a GPU reset to its result: the tool's run and the settle "
            "period, by result.",
            ["result"],
            registry=registry,
            buckets=(1, 2.5, 5, 10, 15, 20, 30, 45, 60, 90, 120, 300, 600),
        )
        self.gpu_reset_escalated = Gauge(
            "gpudaemon_gpu_reset_escalated",
            "1 while a GPU's resets are spent (remediation.max_attempts in 24 h) and its "
            "action is escalated to reboot_node.",
            ["gpu", "uuid"],
            registry=registry,
        )
        self.node_writes = Counter(
            "gpudaemon_node_writes",
            "Writes of the agent's labels/annotations, by result.",
            ["result"],
            registry=registry,
        )
        self.last_reconcile_timestamp_seconds = Gauge(
            "gpudaemon_last_reconcile_timestamp_seconds",
            "UNIX time of the last label reconcile that succeeded (written or unchanged).",
            registry=registry,
        )
        # DRA (dra.enabled): the DeviceTaintRules written for sick GPUs, and the slice
        # entries of NVIDIA's driver that were unusable (no name or UUID) and skipped.
        self.device_taint_writes = Counter(
            "gpudaemon_device_taint_writes",
            "DeviceTaintRule writes for unhealthy GPUs (DRA), by result.",
            ["result"],
            registry=registry,
        )
        self.dra_devices_skipped = Counter(
            "gpudaemon_dra_devices_skipped",
            "Devices in this node's ResourceSlices skipped as unusable (no valid name or UUID).",
            registry=registry,
        )
        self.build_info = Gauge(
            "gpudaemon_build_info",
            "Build information; always 1.",
            ["version", "backend"],
            registry=registry,
        )
        for job in ("telemetry", "inventory", "labels", "history", "pods"):
            self.poll_errors.labels(job)
            self.job_overruns.labels(job)
        for result in ("success", "error", "unchanged"):
            self.node_writes.labels(result)

    def set_build(self, backend: str) -> None:
        self.build_info.labels(__version__, backend).set(1)
