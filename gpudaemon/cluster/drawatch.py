"""The DRA informers: one shared informer (kube/informers.py) per kind of
resource.k8s.io/v1 (read-only, paged lists and watches, as the other informers), into a
ClusterState's DRA store, each object parsed as it arrives. Shared by the extender and
the rebalancer, each wiring them into its factory only with `dra.enabled` on."""

from __future__ import annotations

from gpudaemon.cluster.clusterstate import ClusterState
from gpudaemon.cluster.dra import kept_form
from gpudaemon.cluster.metrics import DRA_KINDS
from gpudaemon.kube.informers import Informer, InformerFactory, by_namespace

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


# One transform per kind, so asking the factory twice for a kind asks in the same form.
_KEEP = {kind: kept_form(kind) for kind in DRA_KINDS}


def dra_informers(factory: InformerFactory, c: ClusterState) -> list[Informer]:
    """The factory's informer for each kind, `c`'s DRA store registered as its handler.
    Each object kept in its parsed form (`dra.kept_form`) from the moment its page or
    event arrives: memory is bounded by what the store keeps, not by what was written,
    so the informers keep their stores too (a few hundred bytes an object, the parsed
    value shared with `c`'s); claims are indexed by namespace."""
    informers = []
    for kind in DRA_KINDS:
        inf = factory.informer(
            kind, DRA_PATH + kind, transform=_KEEP[kind], page_size=PAGE_SIZE.get(kind),
            optional=OPTIONAL.get(kind, ""),
        )  # fmt: skip
        inf.add_handler(c.dra_replace(kind), c.dra_event(kind))
        if kind == "resourceclaims":
            inf.add_indexer("namespace", by_namespace)
        informers.append(inf)
    return informers
