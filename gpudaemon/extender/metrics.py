"""The extender's own metrics: request latency by verb, filter outcomes by reason,
and the caches' sizes and ages (a watch that silently stopped shows as a growing age)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from gpudaemon.extender.cluster import ClusterState

from gpudaemon.extender.pods import REASONS
from gpudaemon.extender.state import NodeState

# Sub-millisecond to the scheduler's usual 5 s httpTimeout.
_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class ExtenderMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.request_seconds = Histogram(
            "gpudaemon_extender_request_duration_seconds",
            "Time to answer a scheduler request, by verb.",
            ["verb"],
            buckets=_BUCKETS_S,
            registry=registry,
        )
        self.requests = Counter(
            "gpudaemon_extender_requests_total",
            "Scheduler requests by verb and HTTP status code.",
            ["verb", "code"],
            registry=registry,
        )
        self.filter_nodes = Counter(
            "gpudaemon_extender_filter_nodes_total",
            "Nodes judged by /filter, by result (passed, or why the node was removed).",
            ["result"],
            registry=registry,
        )
        self.assumed = Counter(
            "gpudaemon_extender_assumed_pods_total",
            "Pods provisionally counted on the node ranked best for them.",
            registry=registry,
        )
        self.unverified = Counter(
            "gpudaemon_extender_unverified_pods_total",
            "Requests whose pod was not booked or learned from, by reason: not a real,"
            " unbound pod of this scheduler (unknown_pod, bound, other_scheduler, no_uid),"
            " or not checkable now (rate_limited, api_error).",
            ["reason"],
            registry=registry,
        )
        for reason in REASONS:
            self.unverified.labels(reason)
        for r in (
            "passed",
            "bad_data",
            "no_agent",
            "stale",
            "unhealthy",
            "insufficient_gpus",
            "insufficient_mig",
            "reserved",
            "outranked",
            "unknown_policy",
        ):
            self.filter_nodes.labels(r)
        for v in ("filter", "prioritize"):
            self.request_seconds.labels(v)


def node_gpus(st: NodeState) -> tuple[int, int]:
    """(total, healthy) GPUs of a node: the agent's count, else what the node offers.
    Shared with `gpudaemon status`, so the dashboard and the command agree."""
    total = st.gpus_total if st.has_agent_labels else st.gpus_allocatable
    return total, max(0, total - st.gpus_unhealthy)


class NodeCollector(Collector):
    """Per GPU node, at scrape time from the caches: GPUs by kind and freshness, the
    figures of `gpudaemon status`, for the fleet dashboard. One series per node and
    kind: 25,000 at 5,000 nodes, built in milliseconds from memory."""

    def __init__(self, cluster: ClusterState) -> None:
        self.cluster = cluster

    def collect(self) -> Iterator[GaugeMetricFamily]:
        gpus = GaugeMetricFamily(
            "gpudaemon_extender_node_gpus",
            "GPUs of a node by kind: total (the agent's count), healthy, allocated (bound "
            "pods' requests), free (allocatable - allocated - unhealthy).",
            labels=["node", "kind"],
        )
        fresh = GaugeMetricFamily(
            "gpudaemon_extender_node_fresh",
            "1 while the node's agent Lease is unexpired and owned by this Node, else 0.",
            labels=["node"],
        )
        names = self.cluster.gpu_node_names()
        snap = self.cluster.snapshot(names)
        for name in names:
            st = snap.states.get(name)
            if st is None:
                continue
            total, healthy = node_gpus(st)
            for kind, v in (
                ("total", total),
                ("healthy", healthy),
                ("allocated", st.gpus_requested),
                ("free", st.gpus_free),
            ):
                gpus.add_metric([name, kind], v)
            fresh.add_metric([name], 1 if snap.fresh.get(name) else 0)
        yield gpus
        yield fresh


class CacheCollector(Collector):
    """Reads sizes and ages at scrape time from the caches (no API calls)."""

    def __init__(
        self,
        sizes: Callable[[], Mapping[str, int]],
        ages_s: Callable[[], Mapping[str, float | None]],
    ) -> None:
        self.sizes, self.ages_s = sizes, ages_s

    def collect(self) -> Iterator[GaugeMetricFamily]:
        objects = GaugeMetricFamily(
            "gpudaemon_extender_cache_objects",
            "Objects in the extender's caches (assumed: pods counted before their binding).",
            labels=["kind"],
        )
        for kind, n in sorted(self.sizes().items()):
            objects.add_metric([kind], n)
        yield objects
        age = GaugeMetricFamily(
            "gpudaemon_extender_cache_age_seconds",
            "Seconds since the cache last heard from its watch (list, event or bookmark).",
            labels=["kind"],
        )
        for kind, a in sorted(self.ages_s().items()):
            if a is not None:
                age.add_metric([kind], a)
        yield age


# The values a node writes that its readers parse (issue 28), and "node": a Node object
# that could not be read at all. Listed so each series exists from the start, at 0.
BAD_VALUE_KEYS = ("gpus", "gpu.count", "gpu.healthy", "gpu.unhealthy", "node")


class BadDataCollector(Collector):
    """What a node wrote that could not be read, by key, and objects a watch handler
    could not take, by watch: read at scrape time from counts the caches keep. Shared
    by the extender and the rebalancer (`program` names the series)."""

    def __init__(
        self,
        program: str,
        bad_values: Callable[[], Mapping[str, int]],
        handler_errors: Callable[[], Mapping[str, int]],
    ) -> None:
        self.program, self.bad_values, self.handler_errors = program, bad_values, handler_errors

    def collect(self) -> Iterator[CounterMetricFamily]:
        bad = CounterMetricFamily(
            f"gpudaemon_{self.program}_bad_node_values",
            "Values a node's agent wrote that could not be read (over a size, depth or "
            "entry cap, or not of the schema), by key; counted once per node and value. "
            "Such a node has no data until it writes a readable one.",
            labels=["key"],
        )
        counts = self.bad_values()
        for key in sorted({*BAD_VALUE_KEYS, *counts}):
            bad.add_metric([key], counts.get(key, 0))
        yield bad
        errors = CounterMetricFamily(
            f"gpudaemon_{self.program}_watch_handler_errors",
            "Objects a watch's handler could not take (it raised), by watch: skipped, "
            "logged once each; should stay 0.",
            labels=["kind"],
        )
        for kind, n in sorted(self.handler_errors().items()):
            errors.add_metric([kind], n)
        yield errors
