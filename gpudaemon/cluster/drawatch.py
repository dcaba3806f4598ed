"""The DRA informers: one Reflector per kind of resource.k8s.io/v1 (read-only, paged
lists and watches, as the other informers), into a ClusterState's DRA store, each
object parsed as it arrives. Shared by
the extender and the rebalancer, each wiring them only with `dra.enabled` on."""

from __future__ import annotations

from collections.abc import Callable

from gpudaemon.cluster.clusterstate import ClusterState
from gpudaemon.cluster.dra import kept_form
from gpudaemon.cluster.metrics import DRA_KINDS
from gpudaemon.kube.backoff import Backoff
from gpudaemon.kube.informer import ListWatchClient, Reflector

DRA_PATH = "/apis/resource.k8s.io/v1/"
# Kinds an API server may not serve: the DRA parts that work without them still work.
OPTIONAL = {
    "devicetaintrules": "resource.k8s.io/v1 DeviceTaintRule is served from Kubernetes 1.37",
}


# Kinds any tenant writes, each object up to etcd's 1.5 MB: listed in small pages, so
# one page in flight (its JSON, then decoded, before it is kept) is about 15 MB of JSON
# at worst, not 500 objects' worth (bench/tenant_claims: 100 claims of 1.3 MB cost 20
# MiB of RSS at 5 a page, 80 at 20). 10,000 ordinary claims list in 1,000 requests.
PAGE_SIZE = {"resourceclaims": 10, "resourceclaimtemplates": 10}


def dra_reflectors(
    client: ListWatchClient, c: ClusterState, cap_s: float, clock: Callable[[], float]
) -> list[Reflector]:
    """Each object kept in its parsed form (`dra.kept_form`) from the moment its page or
    event arrives: memory is bounded by what the store keeps, not by what was written."""
    return [
        Reflector(client, kind, DRA_PATH + kind, c.dra_replace(kind), c.dra_event(kind),
                  backoff=Backoff(0.5, cap_s), clock=clock, optional=OPTIONAL.get(kind, ""),
                  transform=kept_form(kind), page_size=PAGE_SIZE.get(kind))
        for kind in DRA_KINDS
    ]  # fmt: skip
