"""What the extender, the rebalancer and `gpudaemon status` count alike: a node's GPUs,
and the node values and watch objects that could not be read."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from gpudaemon.cluster.state import NodeState
from gpudaemon.labels.keys import GPU_COUNT, GPU_HEALTHY, GPU_UNHEALTHY, GPUS_ANNOTATION


def node_gpus(st: NodeState) -> tuple[int, int]:
    """(total, healthy) GPUs of a node: the agent's count, else what the node offers.
    Shared with `gpudaemon status`, so the dashboard and the command agree."""
    total = st.gpus_total if st.has_agent_labels else st.gpus_allocatable
    return total, max(0, total - st.gpus_unhealthy)


# The values a node writes that its readers parse (issue 28), and "node": a Node object
# that could not be read at all. Listed so each series exists from the start, at 0.
BAD_VALUE_KEYS = (GPUS_ANNOTATION, GPU_COUNT, GPU_HEALTHY, GPU_UNHEALTHY, "node")


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


class DraCollector(Collector):
    """DRA objects skipped as unreadable, by kind, and claims judged with no opinion,
    by reason (cluster/dra.py NOT_UNDERSTOOD): read at scrape time from the store."""

    def __init__(
        self,
        program: str,
        counts: Callable[[], tuple[Mapping[str, int], Mapping[str, int]]],
        claims: bool = True,  # the rebalancer judges no pod's claims: no such series
    ) -> None:
        self.program, self.counts, self.claims = program, counts, claims

    def collect(self) -> Iterator[CounterMetricFamily]:
        from gpudaemon.cluster.dra import NOT_UNDERSTOOD

        bad, not_understood = self.counts()
        fam = CounterMetricFamily(
            f"gpudaemon_{self.program}_dra_claims_not_understood",
            "Pods' DRA claims the extender has no opinion on (never filters a node out "
            "for), by reason: another driver's devices, CEL it cannot evaluate, adminAccess, "
            "allocationMode All, tolerations, ...; counted once per claim and reason.",
            labels=["reason"],
        )
        for reason in sorted({*NOT_UNDERSTOOD, *not_understood}):
            fam.add_metric([reason], not_understood.get(reason, 0))
        if self.claims:
            yield fam
        skipped = CounterMetricFamily(
            f"gpudaemon_{self.program}_dra_bad_objects",
            "DRA objects (resource.k8s.io/v1) that could not be read (over a cap or not of "
            "the schema), by kind: skipped.",
            labels=["kind"],
        )
        for kind in sorted({*DRA_KINDS, *bad}):
            skipped.add_metric([kind], bad.get(kind, 0))
        yield skipped


DRA_KINDS = ("resourceslices", "resourceclaims", "resourceclaimtemplates", "deviceclasses",
             "devicetaintrules")  # fmt: skip
