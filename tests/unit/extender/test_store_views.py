"""The informers' stores as the one store: a Node, a bound pod, an agent Lease and a
pending pod are kept once, in the form their reader needs (`keep`), and ClusterState and
PendingPods read those stores as views, keeping only what is derived from them. A store
handler sees each record before and after, in order with the plain handlers, and a relist
gives what a fresh start on the same objects gives."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry

from gpudaemon.cluster.clusterstate import BoundPod, ClusterState, NodeRecord
from gpudaemon.cluster.state import PodShape
from gpudaemon.config import Config, load_config
from gpudaemon.errors import KubeGoneError
from gpudaemon.extender.app import Extender
from gpudaemon.extender.pods import PendingPods, RealPod
from gpudaemon.kube.informers import InformerFactory, Store, uid_key
from gpudaemon.kube.lease import lease_path
from gpudaemon.rebalancer.app import Rebalancer
from tests.unit.extender.test_cluster import P, lease_obj, node_obj, pod_obj
from tests.unit.extender.test_gang import gang_pod
from tests.unit.extender.test_registry import NoApi
from tests.unit.rebalancer.fake_kube import FakeKube
from tests.unit.test_informers import ScriptedClient

PRODUCT = P + "gpu.product"
NODES, PODS, LEASES = "/api/v1/nodes", "/api/v1/pods", lease_path("gpudaemon")
Script = tuple[list[list[Any]], list[list[Any]]]  # (lists, watches) of one informer


class Clients:
    """One ScriptedClient per path: each informer plays its own script."""

    def __init__(self, scripts: Mapping[str, Script]) -> None:
        self.by = {path: ScriptedClient(*script) for path, script in scripts.items()}

    def list_items(
        self,
        path: str,
        query: Mapping[str, str] | None = None,
        transform: Callable[[Any], Any] | None = None,
        page_size: int | None = None,
    ) -> tuple[list[Any], str]:
        return self.by[path].list_items(path, query, transform, page_size)

    def watch(
        self, path: str, rv: str, timeout_s: float = 300.0, query: Mapping[str, str] | None = None
    ) -> Iterator[tuple[str, Any]]:
        return self.by[path].watch(path, rv, timeout_s, query)

    def request(self, method: str, path: str, *, timeout_s: float | None = None) -> Any:
        raise AssertionError("informers never GET")


def wired(scripts: Mapping[str, Script]) -> tuple[ClusterState, InformerFactory, Clients]:
    """A ClusterState on a factory's Node, pod and Lease informers."""
    clients = Clients({NODES: ([], []), PODS: ([], []), LEASES: ([], []), **scripts})
    factory = InformerFactory(clients)
    c = ClusterState(P)
    c.watch(factory, "gpudaemon")
    return c, factory, clients


def run(factory: InformerFactory, clients: Clients) -> None:
    """Each informer until its script is over (a KubeGoneError in one: a relist)."""
    for inf in factory.informers:
        inf.reflector.run(clients.by[inf.path].stop)


def test_a_store_keeps_the_records_its_keep_makes_and_says_what_each_event_changed() -> None:
    store = Store("pods", lambda o: o["spec"]["nodeName"] or None, uid_key)
    old, new = store.replace([pod_obj("a", "n1"), pod_obj("b"), pod_obj("", "n2"), 42])  # type: ignore[list-item]
    # Not kept: no node (keep says None), no UID (no key), not an object at all.
    assert (old, new) == ({}, {"a": "n1"})
    assert store.apply("MODIFIED", pod_obj("a", "n3")) == ("a", "n1", "n3")
    assert store.apply("MODIFIED", pod_obj("a")) == ("a", "n3", None)  # dropped
    assert store.apply("ADDED", pod_obj("c", "n1")) == ("c", None, "n1")
    assert store.apply("DELETED", pod_obj("c", "n1")) == ("c", "n1", None)
    assert store.apply("ADDED", {"spec": {}}) == ("", None, None)  # a keep that raises
    assert len(store) == 0 and store.replace([pod_obj("d", "n9")]) == ({}, {"d": "n9"})


def test_store_handlers_see_old_and_new_records_in_order_with_the_plain_handlers() -> None:
    client = ScriptedClient(
        [[pod_obj("a", "n1")]],
        [[("ADDED", pod_obj("b", "n2")), ("MODIFIED", pod_obj("a", "n3")),
          ("DELETED", pod_obj("b", "n2"))]],
    )  # fmt: skip
    inf = InformerFactory(client).informer(
        "pods", "/api/v1/pods", keep=lambda o: o["spec"]["nodeName"], key=uid_key
    )
    seen: list[Any] = []
    inf.add_handler(lambda items: seen.append(("plain", len(items))),
                    lambda k, o: seen.append(("plain", k)))  # fmt: skip
    inf.add_store_handler(lambda old, new: seen.append(("store", dict(old), dict(new))),
                          lambda *change: seen.append(("store", *change)))  # fmt: skip
    client.watches[0].append(("MODIFIED", pod_obj("a", "n4")))
    inf.reflector.run(client.stop)
    assert seen[:8] == [
        ("plain", 1), ("store", {}, {"a": "n1"}),
        ("plain", "ADDED"), ("store", "ADDED", "b", None, "n2"),
        ("plain", "MODIFIED"), ("store", "MODIFIED", "a", "n1", "n3"),
        ("plain", "DELETED"), ("store", "DELETED", "b", "n2", None),
    ]  # fmt: skip
    assert inf.get("a") == "n4" and inf.keys() == ["a"]


def test_a_failing_store_handler_takes_the_relist_record_by_record() -> None:
    client = ScriptedClient([[pod_obj("a", "n1"), pod_obj("b", "n2")]], [])
    inf = InformerFactory(client).informer(
        "pods", "/api/v1/pods", keep=lambda o: o["spec"]["nodeName"], key=uid_key
    )
    got: list[Any] = []

    def replaced(old: Any, new: Any) -> None:
        if new:
            raise ValueError("a bug in one handler")

    def changed(kind: str, key: str, old: Any, new: Any) -> None:
        if key == "a":
            raise ValueError("and one bad record")
        got.append((kind, key, old, new))

    others: list[Any] = []
    inf.add_store_handler(replaced, changed)
    inf.add_handler(lambda items: others.append(len(items)), lambda k, o: None)
    inf.reflector.run(client.stop)
    assert got == [("ADDED", "b", None, "n2")] and others == [2]
    assert inf.reflector.handler_errors == 1 and inf.keys() == ["a", "b"]


def test_cluster_state_reads_a_node_that_only_the_informer_store_has() -> None:
    c, factory, _ = wired({})
    nodes, pods, _ = factory.informers
    assert nodes.store is not None and pods.store is not None
    nodes.store.apply("ADDED", node_obj("a", gpus=4))  # into the store, no handler called
    pods.store.apply("ADDED", pod_obj("p1", "a", 1))
    st = c.states(["a"])["a"]
    assert st is not None and st.gpus_allocatable == 4
    assert st.gpus_free == 4  # the usage sums are derived: only the handler adds them
    assert isinstance(nodes.get("a"), NodeRecord) and isinstance(pods.get("p1"), BoundPod)
    assert c.is_bound("p1")  # read from the store


def test_the_stores_hold_the_records_not_the_objects_and_the_state_follows_the_watch() -> None:
    now = time.time()
    big = node_obj("a", gpus=8)
    big["status"]["images"] = [{"names": [f"registry/image-{i}"]} for i in range(100)]
    c, factory, clients = wired({
        NODES: ([[big, node_obj("b", uid="ub")]],
                [[("ADDED", node_obj("c", uid="uc")), ("DELETED", node_obj("b", uid="ub"))]]),
        PODS: ([[pod_obj("p1", "a", 2)]],
               [[("ADDED", pod_obj("p2", "a", 1)), ("MODIFIED", pod_obj("p1", "a", 2, "Failed")),
                 ("ADDED", pod_obj("p3", "c", 4))]]),
        LEASES: ([[lease_obj("a", now)]], [[("ADDED", lease_obj("c", now, owner_uid="uc"))]]),
    })  # fmt: skip
    run(factory, clients)
    nodes, pods, leases = factory.informers
    rec = nodes.get("a")
    assert isinstance(rec, NodeRecord) and rec.uid == "u1" and rec.state.gpus_allocatable == 8
    assert sorted(nodes.keys()) == ["a", "c"] and sorted(pods.keys()) == ["p1", "p2", "p3"]
    assert pods.get("p1") == BoundPod("p1", "a", None)  # terminal: kept, not counted
    assert leases.get("a") is not None and leases.get("c") is not None
    st = c.states(["a", "b", "c"])
    assert st["b"] is None
    assert st["a"].gpus_free == 7 and st["c"].gpus_free == 4  # type: ignore[union-attr]
    assert c.freshness(["a", "c"]) == {"a": True, "c": True}
    assert c.sizes() == {"nodes": 2, "pods": 2, "leases": 2, "assumed": 0}


def test_a_relist_gives_what_a_fresh_start_on_the_same_objects_gives() -> None:
    now = time.time()
    nodes_l = [node_obj("a"), node_obj("c", uid="uc")]
    pods_l = [pod_obj("p2", "a", 1), gang_pod("g1", 4, node="c")]
    leases_l = [lease_obj("a", now)]
    gone = KubeGoneError("too old")
    # First a start on other objects, with events, then a relist of the final ones.
    c, factory, clients = wired({
        NODES: ([[node_obj("b")], nodes_l], [[("ADDED", node_obj("a")), gone]]),
        PODS: ([[pod_obj("p9", "b", 8)], pods_l], [[("ADDED", pod_obj("p1", "a", 3)), gone]]),
        LEASES: ([[], leases_l], [[("ADDED", lease_obj("b", now)), gone]]),
    })  # fmt: skip
    c.assume("x1", "a", PodShape(2))
    run(factory, clients)
    fresh = ClusterState(P)
    fresh.replace_nodes(nodes_l)
    fresh.replace_pods(pods_l)
    fresh.replace_leases(leases_l)
    fresh.assume("x1", "a", PodShape(2))
    names = ["a", "b", "c"]
    assert c.states(names) == fresh.states(names)
    assert c.freshness(names) == fresh.freshness(names)
    assert c.gang_nodes("default/train") == fresh.gang_nodes("default/train") == {"c": 1}
    assert c.sizes() == fresh.sizes()


def test_a_later_plain_handler_sees_cluster_state_already_updated() -> None:
    """The rebalancer's Node watch wakes a drain pass after ClusterState took the Node."""
    c, factory, clients = wired(
        {NODES: ([[node_obj("a", gpus=2)]], [[("MODIFIED", node_obj("a", gpus=6))]])}
    )
    nodes = factory.informers[0]
    seen: list[int] = []

    def later(kind: str, obj: Any) -> None:
        st = c.states(["a"])["a"]
        seen.append(st.gpus_allocatable if st is not None else -1)

    nodes.add_handler(lambda items: later("", {}), later)
    run(factory, clients)
    assert seen[:2] == [2, 6]


def test_pending_pods_answer_from_the_store_after_a_relist() -> None:
    client = ScriptedClient(
        [[gang_pod("g1", 2), gang_pod("g2", 2), pod_obj("solo", gpus=1)],
         [gang_pod("g2", 2), pod_obj("new", gpus=4)]],
        [[("ADDED", gang_pod("g3", 1)), ("DELETED", gang_pod("g1", 2)), KubeGoneError("old")]],
    )  # fmt: skip
    factory = InformerFactory(client)
    pending = PendingPods(PRODUCT)
    inf = pending.watch(factory, "gpudaemon-scheduler")
    looked_up = RealPod("looked-up", "default", "looked-up", PodShape(1))
    pending.add(looked_up)  # PodVerifier's, until the watch speaks of it
    assert pending.get("looked-up") is looked_up
    inf.reflector.run(client.stop)  # list, events, relist
    assert isinstance(inf.get("g2"), RealPod)
    assert pending.get("g1") is None and pending.get("g3") is None  # gone at the relist
    assert pending.get("looked-up") is None  # the relist did not have it
    assert pending.get("new") is not None and len(pending) == 2
    assert [p.uid for p in pending.gang_members("default/train")] == ["g2"]
    assert inf.by_index("gang", "default/train") == pending.gang_members("default/train")


def test_a_pending_pod_that_binds_leaves_the_store_and_its_gang() -> None:
    client = ScriptedClient(
        [[gang_pod("g1", 2)]],
        [[("ADDED", gang_pod("g2", 2)), ("MODIFIED", gang_pod("g1", 2, node="n1"))]],
    )
    factory = InformerFactory(client)
    pending = PendingPods(PRODUCT)
    inf = pending.watch(factory, "gpudaemon-scheduler")
    inf.reflector.run(client.stop)
    assert [p.uid for p in pending.gang_members("default/train")] == ["g2"]
    assert inf.keys() == ["g2"] and pending.get("g1") is None
    assert pending.waits_at_permit("default/train")  # Coscheduling's: they may wait


def test_the_extender_reads_its_informers_stores_and_keeps_no_store_less_informer() -> None:
    cfg = load_config(None, environ={})
    ext = Extender(cfg, client=NoApi(), registry=CollectorRegistry())  # type: ignore[arg-type]
    by_kind = {inf.kind: inf for inf in ext.informers.informers}
    assert {"nodes", "pods", "leases", "pending"} <= set(by_kind)
    assert all(inf.store is not None for inf in by_kind.values())
    by_kind["nodes"].store.apply("ADDED", node_obj("a", gpus=4))  # type: ignore[union-attr]
    by_kind["pending"].store.apply("ADDED", pod_obj("w1", gpus=2))  # type: ignore[union-attr]
    st = ext.cluster.states(["a"])["a"]
    assert st is not None and st.gpus_allocatable == 4
    got = ext.pending.get("w1")
    assert got is not None and got.shape.gpus == 2 and len(ext.pending) == 1


def test_the_rebalancer_reads_its_pending_pods_from_the_informer_store() -> None:
    cfg = Config.model_validate({"node_name": "test", "rebalance": {"dry_run": True}})
    rb = Rebalancer(cfg, "rb-a", client=FakeKube(), registry=CollectorRegistry())  # type: ignore[arg-type]
    by_kind = {inf.kind: inf for inf in rb.informers.informers}
    pending = by_kind["pending"].store
    assert pending is not None and by_kind["nodes"].store is not None
    pending.apply("ADDED", pod_obj("w1", gpus=2))
    pending.apply("ADDED", pod_obj("w2", "n1", gpus=1))  # bound: not pending, not kept
    assert set(rb.pending) == {"w1"} and rb._pending_uids() == frozenset({"w1"})
    by_kind["nodes"].store.apply("ADDED", node_obj("n1", gpus=8))
    assert rb.cluster.states(["n1"])["n1"] is not None


def test_the_rebalancers_policies_learn_as_the_extenders_do() -> None:
    """One model: the rebalancer's fragmentation policy learns node capacities from its
    Node store and the workload from the pods arriving at its scheduler (each UID once),
    as the extender's learns at /filter; before, it ranked victims' hosts with an empty
    workload (every node's fragmentation 0)."""
    cfg = Config.model_validate({"node_name": "test", "rebalance": {"dry_run": True}})
    rb = Rebalancer(cfg, "rb-a", client=FakeKube(), registry=CollectorRegistry())  # type: ignore[arg-type]
    by_kind = {inf.kind: inf for inf in rb.informers.informers}
    policy = rb.policy
    assert policy.name == "fragmentation-model"
    workload = policy.workload  # type: ignore[attr-defined]
    by_kind["pending"]._replace([pod_obj("w1", gpus=2)])
    by_kind["pending"]._event("ADDED", pod_obj("w2", gpus=1))
    by_kind["pending"]._event("MODIFIED", pod_obj("w2", gpus=1))  # the same pod: once
    by_kind["pending"]._event("ADDED", pod_obj("cpu", gpus=0))  # no GPU: not a GPU pod
    assert workload.observed == 2
    assert sorted(t.shape.gpus for t in workload.typical()[1]) == [1, 2]
    by_kind["nodes"]._replace([node_obj("n1", gpus=8)])
    assert set(policy._nodes) == {"n1"}  # type: ignore[attr-defined]  # its capacity counts
