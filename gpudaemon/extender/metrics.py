"""The extender's own metrics: request latency by verb, filter outcomes by reason,
and the caches' sizes and ages (a watch that silently stopped shows as a growing age)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from gpudaemon.cluster.clusterstate import ClusterState

from gpudaemon.cluster.metrics import node_gpus
from gpudaemon.extender.pods import REASONS
from gpudaemon.httpserver.exposition import encode_families, float_text, label_value

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


class NodeCollector(Collector):
    """Per GPU node, at scrape time from the caches: GPUs by kind and freshness, the
    figures of `gpudaemon status`, for the fleet dashboard. One series per node and
    kind: 25,000 at 5,000 nodes. /metrics takes them from render(), which writes the
    text itself: prometheus-client's families and encoder took 0.4-0.6 s a scrape at
    5,000 nodes (holding the GIL that /filter needs), render() 27 ms."""

    KINDS = ("total", "healthy", "allocated", "free")
    GPUS = "gpudaemon_extender_node_gpus"
    FRESH = "gpudaemon_extender_node_fresh"

    def __init__(self, cluster: ClusterState) -> None:
        self.cluster = cluster

    def _families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        gpus = GaugeMetricFamily(
            self.GPUS,
            "GPUs of a node by kind: total (the agent's count), healthy, allocated (bound "
            "pods' requests), free (allocatable - allocated - unhealthy).",
            labels=["node", "kind"],
        )
        fresh = GaugeMetricFamily(
            self.FRESH,
            "1 while the node's agent Lease is unexpired and owned by this Node, else 0.",
            labels=["node"],
        )
        return gpus, fresh

    def _rows(self) -> Iterator[tuple[str, tuple[float, ...], int]]:
        """(node, its GPUs by kind in KINDS order, fresh) for each GPU node."""
        names = self.cluster.gpu_node_names()
        snap = self.cluster.snapshot(names)
        for name in names:
            st = snap.states.get(name)
            if st is None:
                continue
            total, healthy = node_gpus(st)
            kinds = (total, healthy, st.gpus_requested, st.gpus_free)
            yield name, kinds, 1 if snap.fresh.get(name) else 0

    def collect(self) -> Iterator[GaugeMetricFamily]:
        gpus, fresh = self._families()
        for name, kinds, is_fresh in self._rows():
            for kind, v in zip(self.KINDS, kinds, strict=True):
                gpus.add_metric([name, kind], v)
            fresh.add_metric([name], is_fresh)
        yield gpus
        yield fresh

    def render(self, openmetrics: bool) -> bytes:
        """collect()'s families as exposition text, byte for byte what prometheus-client
        writes for them (tests/unit/extender/test_node_metrics.py), without a sample object
        or a label formatted per series: each node's name is escaped once."""
        gpus_head, fresh_head = (encode_families((fam,), openmetrics) for fam in self._families())
        values: dict[float, str] = {}
        gpus: list[str] = []
        fresh: list[str] = []
        for name, kinds, is_fresh in self._rows():
            node = label_value(name)
            for kind, v in zip(self.KINDS, kinds, strict=True):
                text = values.get(v)
                if text is None:
                    text = values[v] = float_text(v)
                gpus.append(f'{self.GPUS}{{kind="{kind}",node="{node}"}} {text}\n')
            fresh.append(f'{self.FRESH}{{node="{node}"}} {float_text(is_fresh)}\n')
        return gpus_head + "".join(gpus).encode() + fresh_head + "".join(fresh).encode()


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
