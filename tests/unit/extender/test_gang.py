"""Gang pods (Coscheduling's scheduling.x-k8s.io/pod-group label) in the extender
(issue 21): held while they wait at Permit, released when the scheduler tries them
again, and kept together on as few nodes, of one product, as fit."""

from __future__ import annotations

import json
from typing import Any

from gpudaemon.extender.cluster import ClusterState
from gpudaemon.extender.podspec import GANG_LABEL, pod_gang
from gpudaemon.extender.state import PodShape
from tests.clock import FakeClock
from tests.unit.extender.test_api import call, make_api
from tests.unit.extender.test_cluster import node_obj, pod_obj


def gang_pod(uid: str, gpus: int, group: str = "train", node: str = "") -> dict[str, Any]:
    p = pod_obj(uid, node, gpus)
    p["metadata"]["labels"] = {GANG_LABEL: group}
    return p


def test_the_gang_is_namespaced() -> None:
    assert pod_gang(gang_pod("u", 1)) == "default/train"
    assert pod_gang(pod_obj("u")) == ""


def test_a_waiting_gang_pod_stays_counted_past_the_plain_ttl_until_tried_again() -> None:
    clock = FakeClock()
    c = ClusterState(assume_ttl_s=30, gang_assume_ttl_s=600, clock=clock)
    c.replace_nodes([node_obj("a")])
    c.assume("g1", "a", PodShape(8), gang="default/train")
    c.assume("p1", "a", PodShape(0, mig=()), gang="")  # no GPUs: not counted at all
    clock.t += 120  # past the plain TTL: a gang pod waiting at Permit is still counted
    assert c.states(["a"])["a"].gpus_free == 0  # type: ignore[union-attr]
    assert c.gang_nodes("default/train") == {"a": 1}
    c.unassume("g1")  # the scheduler tries it again: its placement did not happen
    assert c.states(["a"])["a"].gpus_free == 8  # type: ignore[union-attr]
    assert c.gang_nodes("default/train") == {}


def test_bound_gang_pods_mark_their_nodes_and_a_relist_keeps_assumptions() -> None:
    c = ClusterState()
    c.replace_nodes([node_obj("a"), node_obj("b", uid="u2")])
    c.replace_pods([gang_pod("g1", 2, node="a")])
    c.assume("g2", "b", PodShape(2), gang="default/train")
    assert c.gang_nodes("default/train") == {"a": 1, "b": 1}
    c.replace_pods([gang_pod("g1", 2, node="a")])  # a relist: the assumption stays
    assert c.gang_nodes("default/train") == {"a": 1, "b": 1}
    assert c.states(["b"])["b"].gpus_free == 6  # type: ignore[union-attr]
    c.pod_event("DELETED", gang_pod("g1", 2, node="a"))
    assert c.gang_nodes("default/train") == {"b": 1}


def test_gang_pods_follow_their_gang_over_a_fuller_node() -> None:
    """Bin-packing alone would send the second member to `a` (6 of 8 used); the gang
    holds `c`, which still has room, so it goes there."""
    api, c, _ = make_api()
    first = gang_pod("m1", 2)
    _, res = call(api, "/prioritize", json.dumps({"Pod": first, "NodeNames": ["c"]}).encode())
    assert c.gang_nodes("default/train") == {"c": 1}
    second = gang_pod("m2", 2)
    _, res = call(
        api, "/prioritize", json.dumps({"Pod": second, "NodeNames": ["a", "b", "c"]}).encode()
    )
    top = max(res, key=lambda r: r["Score"])
    assert top["Host"] == "c"
    assert c.gang_nodes("default/train") == {"c": 2}
    # Without the label the same pod packs onto `a`, as bin-packing says.
    _, res = call(
        api,
        "/prioritize",
        json.dumps({"Pod": pod_obj("solo", "", 2), "NodeNames": ["a", "b", "c"]}).encode(),
    )
    assert max(res, key=lambda r: r["Score"])["Host"] == "a"


def test_filtering_a_gang_pod_again_releases_its_old_placement() -> None:
    api, c, _ = make_api()
    p = gang_pod("m1", 2)
    call(api, "/prioritize", json.dumps({"Pod": p, "NodeNames": ["c"]}).encode())
    assert c.states(["c"])["c"].gpus_free == 6  # type: ignore[union-attr]
    call(api, "/filter", json.dumps({"Pod": p, "NodeNames": ["a", "b", "c"]}).encode())
    assert c.states(["c"])["c"].gpus_free == 8  # type: ignore[union-attr]


def test_a_pod_marked_unschedulable_after_its_assumption_is_no_longer_counted() -> None:
    from gpudaemon.extender.app import unschedulable_since
    from gpudaemon.kube.lease import micro_time

    wall = FakeClock()
    c = ClusterState(wall=wall)
    c.replace_nodes([node_obj("a")])
    c.assume("g1", "a", PodShape(8), gang="default/train")
    before = gang_pod("g1", 8)
    before["status"]["conditions"] = [
        {
            "type": "PodScheduled",
            "status": "False",
            "lastTransitionTime": micro_time(wall() - 60)[:19] + "Z",
        }
    ]
    failed = unschedulable_since(before)
    assert failed is not None
    c.unassume_if_failed_since("g1", failed)  # an old failure: the assumption stands
    assert c.states(["a"])["a"].gpus_free == 0  # type: ignore[union-attr]
    after = gang_pod("g1", 8)
    after["status"]["conditions"] = [
        {
            "type": "PodScheduled",
            "status": "False",
            "lastTransitionTime": micro_time(wall() + 1)[:19] + "Z",
        }
    ]
    c.unassume_if_failed_since("g1", unschedulable_since(after))  # type: ignore[arg-type]
    assert c.states(["a"])["a"].gpus_free == 8  # type: ignore[union-attr]
    assert unschedulable_since(gang_pod("x", 1)) is None
