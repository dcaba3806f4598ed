"""ClusterState: free GPUs from informer events, assumptions, and Lease freshness."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gpudaemon.cluster.clusterstate import ClusterState
from gpudaemon.cluster.state import PodShape
from gpudaemon.kube.lease import lease_is_fresh, micro_time
from tests.clock import FakeClock

P = "gpudaemon.io/"


def node_obj(
    name: str,
    gpus: int = 8,
    healthy: int | None = None,
    uid: str = "u1",
    util: list[int] | None = None,
) -> dict[str, Any]:
    labels = {
        P + "gpu.count": str(gpus),
        P + "gpu.healthy": str(gpus if healthy is None else healthy),
        P + "gpu.product": "NVIDIA-H100",
    }
    ann = {}
    if util is not None:
        ann[P + "gpus"] = (
            "["
            + ",".join(
                f'{{"index":{i},"uuid":"GPU-{i}","memory_total_mib":81559,"utilization_pct":{u}}}'
                for i, u in enumerate(util)
            )
            + "]"
        )
    return {
        "metadata": {"name": name, "uid": uid, "labels": labels, "annotations": ann},
        "status": {"allocatable": {"nvidia.com/gpu": str(gpus), "cpu": "64", "memory": "256Gi"}},
    }


def pod_obj(uid: str, node: str = "", gpus: int = 1, phase: str = "Pending") -> dict[str, Any]:
    return {
        "metadata": {"uid": uid, "name": uid, "namespace": "default"},
        "spec": {
            "nodeName": node,
            "containers": [
                {"name": "c", "resources": {"requests": {"nvidia.com/gpu": str(gpus), "cpu": "1"}}}
            ],
        },
        "status": {"phase": phase},
    }


def lease_obj(
    name: str, renewed: float, duration: int = 300, owner_uid: str = "u1"
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "ownerReferences": [{"kind": "Node", "name": name, "uid": owner_uid}],
        },
        "spec": {"renewTime": micro_time(renewed), "leaseDurationSeconds": duration},
    }


def test_free_gpus_follow_bound_non_terminal_pods() -> None:
    c = ClusterState(P)
    c.replace_nodes([node_obj("a")])
    c.replace_pods([pod_obj("p1", "a", 2), pod_obj("p2", "a", 1, phase="Running")])
    assert c.states(["a"])["a"].gpus_free == 5  # type: ignore[union-attr]
    c.pod_event("MODIFIED", pod_obj("p1", "a", 2, phase="Succeeded"))  # terminal frees
    assert c.states(["a"])["a"].gpus_free == 7  # type: ignore[union-attr]
    c.pod_event("DELETED", pod_obj("p2", "a", 1))
    assert c.states(["a"])["a"].gpus_free == 8  # type: ignore[union-attr]
    c.pod_event("MODIFIED", pod_obj("p2", "a", 1))  # an update after delete re-adds once
    c.pod_event("MODIFIED", pod_obj("p2", "a", 1))
    assert c.states(["a"])["a"].gpus_free == 7  # type: ignore[union-attr]


def test_unknown_node_and_unhealthy_gpus() -> None:
    c = ClusterState(P)
    c.replace_nodes([node_obj("a", healthy=7, util=[50, 70])])
    st = c.states(["a", "zz"])
    assert st["zz"] is None
    a = st["a"]
    assert a is not None and a.gpus_unhealthy == 1 and a.gpus_free == 7
    assert a.utilization_ratio == 0.6
    assert a.cpu_allocatable_milli == 64000 and a.memory_allocatable_bytes == 256 * 2**30


def test_assumption_counts_until_the_binding_is_seen_wherever_it_lands() -> None:
    clock = FakeClock()
    c = ClusterState(P, assume_ttl_s=30, clock=clock)
    c.replace_nodes([node_obj("a"), node_obj("b", uid="u2")])
    c.replace_pods([])
    c.assume("p1", "a", PodShape(4))
    assert c.states(["a"])["a"].gpus_free == 4  # type: ignore[union-attr]
    c.assume("p1", "a", PodShape(4))  # the same pod again: not counted twice
    assert c.states(["a"])["a"].gpus_free == 4  # type: ignore[union-attr]
    # the scheduler chose b after all: the watch corrects both nodes
    c.pod_event("ADDED", pod_obj("p1", "b", 4))
    s = c.states(["a", "b"])
    assert s["a"].gpus_free == 8 and s["b"].gpus_free == 4  # type: ignore[union-attr]
    # an already-bound pod is never assumed again
    c.assume("p1", "a", PodShape(4))
    assert c.states(["a"])["a"].gpus_free == 8  # type: ignore[union-attr]


def test_assumption_expires() -> None:
    clock = FakeClock()
    c = ClusterState(P, assume_ttl_s=30, clock=clock)
    c.replace_nodes([node_obj("a")])
    c.assume("p1", "a", PodShape(2))
    clock.advance(29)
    assert c.states(["a"])["a"].gpus_free == 6  # type: ignore[union-attr]
    clock.advance(2)
    assert c.states(["a"])["a"].gpus_free == 8  # type: ignore[union-attr]
    assert c.sizes()["assumed"] == 0


def test_deleted_pending_pod_drops_its_assumption() -> None:
    c = ClusterState(P)
    c.replace_nodes([node_obj("a")])
    c.assume("p1", "a", PodShape(2))
    c.pod_event("DELETED", pod_obj("p1"))
    assert c.states(["a"])["a"].gpus_free == 8  # type: ignore[union-attr]


def test_a_pod_leaving_the_pending_watch_keeps_its_assumption_two_seconds_at_most() -> None:
    """The extender's bound-pod watch never sees a pod deleted while pending; the
    pending watch's DELETED (deleted, or bound: it carries the pod as it was) ends its
    assumption within LEFT_PENDING_GRACE_S, not the TTL; a binding seen within that
    grace replaces it as usual."""
    clock = FakeClock()
    c = ClusterState(P, assume_ttl_s=30, clock=clock)
    c.replace_nodes([node_obj("a")])
    c.replace_pods([])
    for i in range(4):
        c.assume(f"p{i}", "a", PodShape(2))
    assert c.states(["a"])["a"].gpus_free == 0  # type: ignore[union-attr]
    for i in range(4):
        c.left_pending(f"p{i}")
    c.pod_event("ADDED", pod_obj("p3", "a", 2))  # p3 had bound: counted as bound
    clock.advance(1.9)
    assert c.states(["a"])["a"].gpus_free == 0  # type: ignore[union-attr]
    clock.advance(0.2)
    assert c.states(["a"])["a"].gpus_free == 6  # type: ignore[union-attr]
    assert c.sizes()["assumed"] == 0


def test_freshness_uses_the_agents_rule() -> None:
    from datetime import UTC, datetime

    wall = FakeClock()
    c = ClusterState(P, wall=wall)
    c.replace_nodes([node_obj("a"), node_obj("b", uid="u2")])
    leases = [lease_obj("a", wall() - 100, 300), lease_obj("b", wall() - 400, 300, owner_uid="u2")]
    c.replace_leases(leases)
    now = datetime.fromtimestamp(wall(), UTC)
    for lease in leases:  # same verdict as the renewer's own rule
        assert c.fresh(lease["metadata"]["name"]) == lease_is_fresh(lease, now)
    assert c.fresh("a") and not c.fresh("b") and not c.fresh("nolease")
    wall.advance(201)
    assert not c.fresh("a")


def test_lease_of_a_deleted_node_vouches_for_nothing() -> None:
    wall = FakeClock()
    c = ClusterState(P, wall=wall)
    c.replace_nodes([node_obj("a", uid="new")])
    c.replace_leases([lease_obj("a", wall(), 300, owner_uid="old")])
    assert not c.fresh("a")
    c.lease_event("MODIFIED", lease_obj("a", wall(), 300, owner_uid="new"))
    assert c.fresh("a")
    c.lease_event("DELETED", lease_obj("a", wall()))
    assert not c.fresh("a")


def test_node_deleted_and_relist_replaces_everything() -> None:
    c = ClusterState(P)
    c.replace_nodes([node_obj("a"), node_obj("b")])
    c.node_event("DELETED", node_obj("a"))
    assert c.states(["a"])["a"] is None
    c.replace_nodes([node_obj("c")])
    assert c.sizes()["nodes"] == 1


_events = st.lists(
    st.one_of(
        st.tuples(st.just("node"), st.sampled_from(["ADDED", "MODIFIED", "DELETED"]),
                  st.sampled_from("ab"), st.sampled_from(["u1", "u2", ""])),
        st.tuples(st.just("lease"), st.sampled_from(["ADDED", "MODIFIED", "DELETED"]),
                  st.sampled_from("ab"), st.sampled_from(["u1", "u2", ""])),
        st.tuples(st.just("relist-nodes"), st.just(""), st.sampled_from("ab"),
                  st.sampled_from(["u1", "u2"])),
        st.tuples(st.just("relist-leases"), st.just(""), st.sampled_from("ab"),
                  st.sampled_from(["u1", "u2", ""])),
        st.tuples(st.just("tick"), st.just(""), st.just(""), st.just("")),
    ),
    max_size=30,
)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(_events)
def test_precomputed_freshness_equals_the_rule_applied_to_the_objects(
    events: list[tuple[str, str, str, str]],
) -> None:
    """Freshness is kept per node at event time; in every order of Node and Lease
    events and relists it must equal the rule applied to the objects as they are:
    an unexpired Lease whose owner is this Node object (or names no UID)."""
    wall = FakeClock()
    c = ClusterState(P, wall=wall)
    nodes: dict[str, dict[str, Any]] = {}
    leases: dict[str, dict[str, Any]] = {}
    for kind, verb, name, uid in events:
        if kind == "node":
            obj = node_obj(name, uid=uid)
            c.node_event(verb, obj)
            if verb == "DELETED":
                nodes.pop(name, None)
            else:
                nodes[name] = obj
        elif kind == "lease":
            obj = lease_obj(name, wall(), 60, owner_uid=uid)
            c.lease_event(verb, obj)
            if verb == "DELETED":
                leases.pop(name, None)
            else:
                leases[name] = obj
        elif kind == "relist-nodes":
            nodes = {name: node_obj(name, uid=uid)}
            c.replace_nodes(list(nodes.values()))
        elif kind == "relist-leases":
            leases = {name: lease_obj(name, wall(), 60, owner_uid=uid)}
            c.replace_leases(list(leases.values()))
        else:
            wall.advance(45)
        for n in "ab":
            lease = leases.get(n)
            owner = (lease or {}).get("metadata", {}).get("ownerReferences", [{}])[0].get("uid", "")
            node_uid = nodes.get(n, {}).get("metadata", {}).get("uid", "")
            expected = (
                lease is not None
                and lease_is_fresh(lease, datetime.fromtimestamp(wall(), UTC))
                and not (owner and node_uid and owner != node_uid)
            )
            assert c.fresh(n) == expected, (n, events)
            assert c.freshness([n]) == {n: expected}
