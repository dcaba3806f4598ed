"""The room the rebalancer made for a pending pod is kept for it (issue 22): other
pods of no higher priority are turned away from that node until it runs out."""

from __future__ import annotations

from typing import Any

from gpudaemon.extender.framework import _kept
from gpudaemon.extender.pods import PendingPods, reservation
from gpudaemon.extender.state import NodeState, PodShape
from tests.unit.extender.test_cluster import pod_obj


def reserved(uid: str, gpus: int, node: str, until: float, priority: int = 0) -> dict[str, Any]:
    p = pod_obj(uid, "", gpus)
    p["metadata"]["annotations"] = {
        "gpudaemon.io/reserved-node": node,
        "gpudaemon.io/reserved-until": str(until),
    }
    p["spec"]["priority"] = priority
    return p


def test_reservations_hold_for_others_of_no_higher_priority_until_they_run_out() -> None:
    pending = PendingPods("gpudaemon.io/gpu.product")
    pending.replace([reserved("big", 8, "n1", until=1000.0, priority=5)])
    st = NodeState("n1", gpus_allocatable=8, gpus_total=8)
    small = PodShape(1)
    why = _kept(pending, st, "n1", small, "small", 5, now=10.0)
    assert why is not None and why.reason == "reserved" and "default/big" in why.message
    assert _kept(pending, st, "n1", small, "small", 6, now=10.0) is None  # higher priority
    assert _kept(pending, st, "n1", PodShape(8), "big", 5, now=10.0) is None  # its own room
    assert _kept(pending, st, "n2", small, "small", 0, now=10.0) is None  # another node
    assert _kept(pending, st, "n1", small, "small", 0, now=1000.0) is None  # ran out
    # A node with room beyond the reservation still takes others.
    roomy = NodeState("n1", gpus_allocatable=16, gpus_total=16)
    assert _kept(pending, roomy, "n1", small, "small", 0, now=10.0) is None
    pending.event("DELETED", reserved("big", 8, "n1", until=1000.0))
    assert not pending.has_reservations()


def test_malformed_reservations_are_ignored() -> None:
    assert reservation(reserved("x", 1, "Not_A_Node", 5.0)) == ("", 0.0)
    bad = reserved("x", 1, "n1", 5.0)
    bad["metadata"]["annotations"]["gpudaemon.io/reserved-until"] = "soon"
    assert reservation(bad) == ("", 0.0)
    assert reservation(reserved("x", 1, "n1", 5.0)) == ("n1", 5.0)
