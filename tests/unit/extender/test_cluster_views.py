"""ClusterState's views (issue 29): one store per resource, shared by every consumer.
A program that needs more of a Node or a pod than NodeState holds (the rebalancer's
placement facts, GPU health, pod facts) registers a reading that the store keeps beside
its own, under the same rules, instead of a mirror cache fed by its own handlers."""

from __future__ import annotations

from typing import Any

from gpudaemon.cluster.clusterstate import ClusterState
from tests.unit.extender.test_cluster import P, node_obj, pod_obj


def _name(obj: Any) -> str:
    return str(obj["metadata"]["name"])


def _pod(obj: Any) -> str | None:
    if obj["metadata"]["name"] == "raises":
        raise TypeError("a reading that cannot take this pod")
    return f"{obj['spec']['nodeName']}:{obj['metadata']['name']}"


def test_node_views_follow_the_nodes_and_leave_out_unreadable_ones() -> None:
    c = ClusterState(node_view=_name, pod_view=_pod)
    bad = node_obj("bad")
    bad["metadata"]["labels"][P + "gpu.count"] = "many"
    c.replace_nodes([node_obj("a"), node_obj("b"), bad])
    assert set(c.views().nodes) == {"a", "b"}  # `bad` is a node with no data: no view
    assert c.bad_reason("bad")
    c.node_event("DELETED", node_obj("b"))
    c.node_event("MODIFIED", bad | {"metadata": {**bad["metadata"], "labels": {}}})
    assert set(c.views().nodes) == {"a", "bad"}  # readable again
    a = node_obj("a")
    a["metadata"]["labels"][P + "gpu.healthy"] = "-1"
    c.node_event("MODIFIED", a)
    assert set(c.views().nodes) == {"bad"}  # a node that turns unreadable loses its view


def test_pod_views_hold_bound_non_terminal_pods_only() -> None:
    c = ClusterState(pod_view=_pod)
    c.replace_pods([pod_obj("p1", "n1"), pod_obj("p2"), pod_obj("p3", "n1", phase="Succeeded"),
                    pod_obj("raises", "n2")])  # fmt: skip
    assert c.views().pods == {"p1": "n1:p1"}
    assert c.is_bound("raises")  # counted all the same, only without a view
    c.pod_event("MODIFIED", pod_obj("p2", "n2"))
    c.pod_event("MODIFIED", pod_obj("p1", "n1", phase="Failed"))
    assert c.views().pods == {"p2": "n2:p2"}
    c.pod_event("DELETED", pod_obj("p2", "n2"))
    assert c.views().pods == {}
    views = c.views()
    c.replace_pods([pod_obj("p9", "n1")])
    assert views.pods == {} and c.views().pods == {"p9": "n1:p9"}  # a copy, not the store
