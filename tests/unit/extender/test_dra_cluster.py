"""ClusterState with DRA: slices fold into NodeState, allocated claims count as used,
tainted devices are not free (and a tainted unhealthy one is subtracted once), a DRA
pod's shape, no opinion for claims not understood, and the assumption that lasts until
the claim's allocation is seen, whichever watch event comes first."""

from __future__ import annotations

import json
from typing import Any

from prometheus_client import CollectorRegistry

from gpudaemon.cluster.clusterstate import ClusterState
from gpudaemon.cluster.podspec import pod_shape
from gpudaemon.config import load_config
from gpudaemon.extender.api import ExtenderApi
from gpudaemon.extender.app import make_policies
from tests.clock import FakeClock
from tests.dra_objects import (
    MIG_CEL,
    claim,
    device_class,
    dra_pod,
    gpu_device,
    gpu_uuid,
    mig_device,
    nvidia_slice,
    taint_rule,
    template,
)
from tests.unit.extender.test_cluster import node_obj

P = "gpudaemon.io/"


def dra_node(name: str, sick: tuple[int, ...] = ()) -> dict[str, Any]:
    """A DRA node: no nvidia.com/gpu allocatable, the agent's labels and annotation."""
    n = node_obj(name, gpus=8, healthy=8 - len(sick))
    del n["status"]["allocatable"]["nvidia.com/gpu"]
    gpus = [{"index": i, "uuid": gpu_uuid(name, i), "memory_total_mib": 81559,
             "healthy": i not in sick, "state": "unhealthy" if i in sick else "healthy",
             "action": "drain" if i in sick else "none"} for i in range(8)]  # fmt: skip
    n["metadata"]["annotations"][P + "gpus"] = json.dumps(gpus)
    n["metadata"]["labels"][P + "gpu.unhealthy"] = str(len(sick))
    return n


def cluster(clock: FakeClock | None = None) -> ClusterState:
    c = ClusterState(dra=True, clock=clock or FakeClock())
    c.dra_replace("deviceclasses")([device_class(), device_class("mig.nvidia.com", MIG_CEL)])
    return c


def test_slices_fold_into_node_state() -> None:
    c = cluster()
    c.replace_nodes([dra_node("n1"), dra_node("n2")])
    c.dra_replace("resourceslices")([nvidia_slice("n1"), nvidia_slice("n2")])
    c.dra_event("resourceclaims")(
        "ADDED", claim("a", 3, allocated=("n1", ["gpu-0", "gpu-1", "gpu-2"]))
    )
    s = c.states(["n1", "n2"])
    assert (s["n1"].gpus_allocatable, s["n1"].gpus_free) == (8, 5)  # type: ignore[union-attr]
    assert s["n2"].gpus_free == 8  # type: ignore[union-attr]
    assert c.gpu_node_names() == ["n1", "n2"]
    c.dra_event("resourceclaims")("DELETED", claim("a"))
    assert c.states(["n1"])["n1"].gpus_free == 8  # type: ignore[union-attr]


def test_without_dra_nothing_is_read() -> None:
    c = ClusterState()
    c.replace_nodes([dra_node("n1")])
    assert c.states(["n1"])["n1"].gpus_free == 0  # type: ignore[union-attr]
    pod = dra_pod("p", [("g", "claim:a")])
    shape = pod_shape(pod, c.product_label)
    assert c.with_dra(pod, shape) is shape


def test_tainted_devices_are_not_free_and_sick_ones_subtracted_once() -> None:
    c = cluster()
    c.replace_nodes([dra_node("n1", sick=(3,))])  # the agent: GPU 3 unhealthy
    taint = [{"key": "k", "effect": "NoSchedule"}]
    c.dra_replace("resourceslices")([nvidia_slice("n1", devices=[
        *(gpu_device("n1", i) for i in range(7)), gpu_device("n1", 7, taint)])])  # fmt: skip
    st = c.states(["n1"])["n1"]
    assert st is not None and st.gpus_free == 6  # 8 - GPU 3 (sick) - GPU 7 (tainted)
    c.dra_event("devicetaintrules")("ADDED", taint_rule("r", "n1", "gpu-3"))  # sick and tainted
    assert c.states(["n1"])["n1"].gpus_free == 6  # type: ignore[union-attr]
    c.dra_event("devicetaintrules")("ADDED", taint_rule("r2", "n1", "gpu-4", "NoExecute"))
    assert c.states(["n1"])["n1"].gpus_free == 5  # type: ignore[union-attr]


def test_mig_devices_by_profile() -> None:
    c = cluster()
    c.replace_nodes([dra_node("n1")])
    c.dra_replace("resourceslices")([nvidia_slice("n1", devices=[
        mig_device("n1", 0, i) for i in range(7)])])  # fmt: skip
    c.dra_event("resourceclaims")("ADDED", claim("m", 1, cls="mig.nvidia.com",
                                                 allocated=("n1", ["gpu-0-mig-1g-10gb-0"])))  # fmt: skip
    assert c.states(["n1"])["n1"].mig_free == {"1g.10gb": 6}  # type: ignore[union-attr]


def test_shape_of_a_dra_pod() -> None:
    c = cluster()
    c.dra_event("resourceclaimtemplates")("ADDED", template("t4", 4))
    c.dra_event("resourceclaims")("ADDED", claim("one", 1))
    pod = dra_pod("p", [("a", "template:t4"), ("b", "claim:one")])
    shape = c.with_dra(pod, pod_shape(pod, c.product_label))
    assert shape.gpus == 5 and shape.cpu_milli == 1000 and shape.wants_gpus
    c.dra_event("resourceclaims")("MODIFIED", claim("one", 1, allocated=("n1", ["gpu-0"])))
    assert c.with_dra(pod, pod_shape(pod, c.product_label)).gpus == 4


def extender(c: ClusterState) -> ExtenderApi:
    cfg = load_config(None, environ={}, overrides={"extender": {"policy": "binpack", "candidates": 0},
                                                     "dra": {"enabled": True}})  # fmt: skip
    return ExtenderApi(c, make_policies(cfg), "binpack", CollectorRegistry(), lambda: (True, ""))


def fresh_cluster(clock: FakeClock) -> ClusterState:
    c = cluster(clock)
    c.replace_nodes([dra_node(f"n{i}") for i in range(3)])
    c.dra_replace("resourceslices")([nvidia_slice(f"n{i}") for i in range(3)])
    c.freshness = lambda names: dict.fromkeys(names, True)  # type: ignore[method-assign]
    c.fresh = lambda name: True  # type: ignore[method-assign]
    return c


def test_filter_and_binpack_judge_dra_pods() -> None:
    c = fresh_cluster(FakeClock())
    c.dra_event("resourceclaims")("ADDED", claim("used", 6, allocated=(
        "n1", [f"gpu-{i}" for i in range(6)])))  # fmt: skip
    c.dra_event("resourceclaims")("ADDED", claim("want", 4))
    api = extender(c)
    pod = dra_pod("p", [("g", "claim:want")])
    res = api.framework.filter(pod, ["n0", "n1", "n2"])
    assert res.passed == ["n0", "n2"] and "n1" in res.failed  # 2 free < 4
    c.dra_event("resourceclaims")("ADDED", claim("want2", 2))
    pod2 = dra_pod("p2", [("g", "claim:want2")])
    scores = dict(api.framework.score(pod2, ["n0", "n1", "n2"]))
    assert max(scores, key=scores.__getitem__) == "n1"  # binpack: the partly used node


def test_no_opinion_never_filters() -> None:
    c = fresh_cluster(FakeClock())
    c.dra_event("resourceclaims")("ADDED", claim("x", 1, cls="unknown-class"))
    api = extender(c)
    pod = dra_pod("p", [("g", "claim:x")])
    assert api.framework.filter(pod, ["n0", "n1"]).passed == ["n0", "n1"]
    assert c.dra_counts()[1] == {"unknown_class": 1}


def test_assumption_lasts_until_the_claim_is_seen_allocated() -> None:
    """Pod event before claim event: the devices stay counted in between."""
    clock = FakeClock()
    c = fresh_cluster(clock)
    c.dra_event("resourceclaims")("ADDED", claim("want", 4))
    pod = dra_pod("p", [("g", "claim:want")])
    shape = c.with_dra(pod, pod_shape(pod, c.product_label))
    c.assume("p", "n0", shape)
    assert c.states(["n0"])["n0"].gpus_free == 4  # type: ignore[union-attr]
    c.pod_event("MODIFIED", dra_pod("p", [("g", "claim:want")], node="n0"))  # bound first
    st = c.states(["n0"])["n0"]
    assert st is not None and st.gpus_free == 4 and st.cpu_requested_milli == 1000
    c.dra_event("resourceclaims")("MODIFIED", claim("want", 4, allocated=(
        "n0", ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]), reserved_for=["p"]))  # fmt: skip
    st = c.states(["n0"])["n0"]
    assert st is not None and st.gpus_free == 4 and st.gpus_assumed == 0
    assert not c.is_assumed("p")


def test_claim_allocated_before_the_pod_binds_is_not_counted_twice() -> None:
    c = fresh_cluster(FakeClock())
    c.dra_event("resourceclaims")("ADDED", claim("want", 2))
    pod = dra_pod("p", [("g", "claim:want")])
    c.assume("p", "n0", c.with_dra(pod, pod_shape(pod, c.product_label)))
    c.dra_event("resourceclaims")(
        "MODIFIED", claim("want", 2, allocated=("n0", ["gpu-0", "gpu-1"]))
    )
    st = c.states(["n0"])["n0"]
    assert st is not None and st.gpus_free == 6 and st.cpu_requested_milli == 1000
    c.pod_event("MODIFIED", dra_pod("p", [("g", "claim:want")], node="n0"))
    st = c.states(["n0"])["n0"]
    assert st is not None and st.gpus_free == 6 and not c.is_assumed("p")


def test_assumption_of_an_unallocated_claim_ends_with_its_ttl() -> None:
    clock = FakeClock()
    c = fresh_cluster(clock)
    c.dra_event("resourceclaims")("ADDED", claim("want", 2))
    pod = dra_pod("p", [("g", "claim:want")])
    c.assume("p", "n0", c.with_dra(pod, pod_shape(pod, c.product_label)))
    c.pod_event("MODIFIED", dra_pod("p", [("g", "claim:want")], node="n0"))
    assert c.states(["n0"])["n0"].gpus_free == 6  # type: ignore[union-attr]
    clock.advance(31)
    assert c.states(["n0"])["n0"].gpus_free == 8  # type: ignore[union-attr]


def test_burst_packs_without_overcommit() -> None:
    """Twelve pods ranked back to back before any watch event: binpack fills the
    partly used node, then one node at a time, never past 8 GPUs a node."""
    c = fresh_cluster(FakeClock())
    c.dra_event("resourceclaims")("ADDED", claim("used", 5, allocated=(
        "n1", [f"gpu-{i}" for i in range(5)])))  # fmt: skip
    api = extender(c)
    placed: dict[str, int] = {}
    for i, n in enumerate([1, 2, 1, 4, 2, 1]):
        c.dra_event("resourceclaims")("ADDED", claim(f"w{i}", n))
        pod = dra_pod(f"p{i}", [("g", f"claim:w{i}")])
        scores = dict(api.framework.score(pod, ["n0", "n1", "n2"]))
        top = max(scores, key=scores.__getitem__)
        placed[top] = placed.get(top, 0) + n
    assert placed["n1"] == 3  # 5 used + 3: full
    assert all(v <= 8 for v in placed.values()) and len(placed) == 2


def test_a_claim_shared_by_two_pending_pods_is_counted_once_on_the_node_assumed() -> None:
    """Pod A is assumed on n0 with a shared claim (resourceClaimName) not yet
    allocated; pod B names the same claim. B's view of n0 does not count the claim's
    GPUs twice (A's share is B's too), the filter's bound counts are unchanged, and
    B's own assumption adds nothing for the claim."""
    c = fresh_cluster(FakeClock())
    c.dra_event("resourceclaims")("ADDED", claim("shared", 4))
    a, b = dra_pod("a", [("g", "claim:shared")]), dra_pod("b", [("g", "claim:shared")])
    sa = c.with_dra(a, pod_shape(a, c.product_label))
    c.assume("a", "n0", sa)
    sb = c.with_dra(b, pod_shape(b, c.product_label))
    assert sb.gpus == 4  # on a node where nobody holds it yet, B needs the claim's GPUs
    plain = c.snapshot(["n0", "n1"]).states["n0"]
    view = c.snapshot(["n0", "n1"], "b", sb).states
    assert plain is not None and plain.gpus_free == 4
    assert view["n0"] is not None and view["n0"].gpus_free == 8  # A's 4 are B's 4
    assert view["n0"].can_host(sb)
    assert view["n0"].gpus_free_bound == plain.gpus_free_bound == 8  # the filter's view
    assert view["n1"] == c.snapshot(["n1"]).states["n1"]
    c.assume("b", "n0", sb)
    st = c.states(["n0"])["n0"]
    assert st is not None and st.gpus_free == 4 and st.gpus_assumed == 4
