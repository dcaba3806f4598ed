"""The DRA informers: one Reflector per kind of resource.k8s.io/v1 (read-only, paged
lists and watches, as the other informers), into a ClusterState's DRA store. Shared by
the extender and the rebalancer, each wiring them only with `dra.enabled` on."""

from __future__ import annotations

from collections.abc import Callable

from gpudaemon.cluster.clusterstate import ClusterState
from gpudaemon.cluster.metrics import DRA_KINDS
from gpudaemon.kube.backoff import Backoff
from gpudaemon.kube.informer import ListWatchClient, Reflector

DRA_PATH = "/apis/resource.k8s.io/v1/"
# Kinds an API server may not serve: the DRA parts that work without them still work.
OPTIONAL = {
    "devicetaintrules": "resource.k8s.io/v1 DeviceTaintRule is served from Kubernetes 1.37",
}


def dra_reflectors(
    client: ListWatchClient, c: ClusterState, cap_s: float, clock: Callable[[], float]
) -> list[Reflector]:
    return [
        Reflector(client, kind, DRA_PATH + kind, c.dra_replace(kind), c.dra_event(kind),
                  backoff=Backoff(0.5, cap_s), clock=clock, optional=OPTIONAL.get(kind, ""))
        for kind in DRA_KINDS
    ]  # fmt: skip
