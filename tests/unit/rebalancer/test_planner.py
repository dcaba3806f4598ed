"""The rebalancer's rules (issue 22), as pure functions of the extender's own node
states: which pods a sick GPU drains, and the cheapest defragmentation plan that holds."""

from __future__ import annotations

from typing import Any

from gpudaemon.cluster.policies import build_policies
from gpudaemon.cluster.state import NodeState, PodShape
from gpudaemon.config import ExtenderConfig
from gpudaemon.rebalancer.fits import PodFit
from gpudaemon.rebalancer.planner import (
    NodeFacts,
    PodFacts,
    SickGpu,
    defragment,
    drain,
    may_land,
    node_facts,
    pod_facts,
)

PRODUCT = "gpudaemon.io/gpu.product"
BINPACK = build_policies(ExtenderConfig())["binpack"]


ALLOCATABLE = {"nvidia.com/gpu": 8, "cpu": 64_000, "memory": 256 << 30, "pods": 110}


def pod(
    name: str,
    node: str = "",
    gpus: int = 1,
    *,
    opted_in: bool = True,
    owned: bool = True,
    priority: int = 0,
    unschedulable: bool = True,
    node_selector: dict[str, str] | None = None,
    tolerations: tuple[dict[str, Any], ...] = (),
    unjudgeable: str = "",
    extra: dict[str, int] | None = None,
    **kw: Any,
) -> PodFacts:
    """A pod of `gpus` GPUs, 1 CPU and 1 GiB; `extra`: more resource requests."""
    requests = {"nvidia.com/gpu": gpus, "cpu": 1000, "memory": 1 << 30, "pods": 1, **(extra or {})}
    fit = PodFit(
        requests=requests,
        node_selector=node_selector or {},
        tolerations=tolerations,
        namespace="ml",
        unjudgeable=unjudgeable,
        signature=repr((sorted(requests.items()), node_selector, tolerations)),
    )
    return PodFacts(
        uid=f"uid-{name}",
        namespace="ml",
        name=name,
        node=node,
        shape=PodShape(gpus, cpu_milli=1000, memory_bytes=1 << 30),
        priority=priority,
        owned=owned,
        opted_in=opted_in,
        unschedulable=unschedulable,
        fit=fit,
        **kw,
    )


def nf(name: str, **kw: Any) -> NodeFacts:
    """A Node's facts: 8 GPUs, 64 CPUs, 256 GiB, 110 pods, unless `allocatable` says."""
    return NodeFacts(name=name, allocatable=kw.pop("allocatable", ALLOCATABLE), **kw)


def state(name: str, used: int, total: int = 8, unhealthy: int = 0) -> NodeState:
    return NodeState(
        name,
        gpu_model="NVIDIA-H100",
        gpus_allocatable=total,
        gpus_requested=used,
        gpus_unhealthy=unhealthy,
        gpus_total=total,
        cpu_allocatable_milli=64_000,
        cpu_requested_milli=used * 1000,
        memory_allocatable_bytes=256 << 30,
        memory_requested_bytes=used << 30,
    )


def cluster(
    used: dict[str, int], per_pod: int = 1
) -> tuple[dict[str, NodeState | None], dict[str, list[PodFacts]]]:
    states: dict[str, NodeState | None] = {n: state(n, u) for n, u in used.items()}
    running = {
        n: [pod(f"{n}-p{i}", n, per_pod) for i in range(u // per_pod)] for n, u in used.items()
    }
    return states, running


def fresh(states: dict[str, Any], stale: tuple[str, ...] = ()) -> dict[str, bool]:
    return {n: n not in stale for n in states}


FACTS: dict[str, NodeFacts] = {}


def facts(states: dict[str, Any]) -> dict[str, NodeFacts]:
    return {n: nf(n) for n in states}


# -- drain ------------------------------------------------------------------------------


def test_a_pod_on_a_sick_gpu_is_evicted_after_the_grace_only() -> None:
    pods = {"ml/a": pod("a", "n1")}
    early = drain(
        [SickGpu("n1", 3, "drain", "xid 79", 10.0, ["ml/a"])], pods, {"n1": True}, grace_s=300
    )
    assert early == []  # no event for each pass of the grace period
    [d] = drain(
        [SickGpu("n1", 3, "drain", "xid 79", 301.0, ["ml/a"])], pods, {"n1": True}, grace_s=300
    )
    assert d.evict and d.kind == "drain" and d.reason == "unhealthy_gpu"
    assert "GPU 3 on n1" in d.message and "xid 79" in d.message


def test_drain_leaves_stale_nodes_bare_pods_and_pods_already_going() -> None:
    pods = {
        "ml/a": pod("a", "n1"),
        "ml/bare": pod("bare", "n2", owned=False),
        "ml/going": pod("going", "n2", terminating=True),
        "ml/moved": pod("moved", "n3"),  # the annotation is older than its move
    }
    sick = [
        SickGpu("n1", 0, "drain", "xid 79", 999.0, ["ml/a"]),
        SickGpu("n2", 0, "drain", "xid 79", 999.0, ["ml/bare", "ml/going", "ml/gone"]),
        SickGpu("n2", 1, "drain", "xid 79", 999.0, ["ml/moved"]),
    ]
    out = {d.pod.name: d for d in drain(sick, pods, {"n1": False, "n2": True}, grace_s=0)}
    assert set(out) == {"a", "bare"}
    assert out["a"].reason == "stale" and not out["a"].evict
    assert out["bare"].reason == "bare_pod" and not out["bare"].evict


def test_a_pod_holding_two_sick_gpus_is_judged_once() -> None:
    pods = {"ml/a": pod("a", "n1", 2)}
    sick = [
        SickGpu("n1", 0, "drain", "xid 79", 999.0, ["ml/a"]),
        SickGpu("n1", 1, "drain", "xid 79", 999.0, ["ml/a"]),
    ]
    assert len(drain(sick, pods, {"n1": True}, grace_s=0)) == 1


# -- defragment ---------------------------------------------------------------------------


def test_the_plan_empties_one_node_and_every_victim_fits_elsewhere() -> None:
    """Four 8-GPU nodes with six 1-GPU pods each (2 free per node): an 8-GPU pod fits
    nowhere, and moving the six pods of one node onto the others' 6 free GPUs makes
    room. Only that node's pods are moved."""
    states, running = cluster({"n1": 6, "n2": 6, "n3": 6, "n4": 6})
    plan = defragment(pod("big", gpus=8), states, fresh(states), facts(states), running, BINPACK)
    assert plan is not None
    assert len(plan.victims) == 6 and {v.node for v in plan.victims} == {plan.node}
    assert plan.node not in plan.targets
    assert sorted(plan.targets).count("n2") <= 2  # each target has 2 free GPUs


def test_the_fewest_evictions_win() -> None:
    states: dict[str, NodeState | None] = {"n1": state("n1", 6), "n2": state("n2", 6),
                                           "n3": state("n3", 4)}  # fmt: skip
    running = {
        "n1": [pod(f"a{i}", "n1") for i in range(6)],  # 4 evictions would free 6
        "n2": [pod("b0", "n2", 4), pod("b1", "n2", 2)],  # 1 eviction (4 GPUs) frees 6
        "n3": [pod("c0", "n3", 2, opted_in=False), pod("c1", "n3", 2, opted_in=False)],
    }
    plan = defragment(pod("big", gpus=6), states, fresh(states), facts(states), running, BINPACK)
    assert plan is not None and plan.node == "n2" and [v.name for v in plan.victims] == ["b0"]
    assert plan.targets == ("n3",)  # n1 has 2 free only; n3 has 4


def test_nothing_to_gain_means_no_plan() -> None:
    # Every node full but 2 GPUs: emptying one cannot place its pods on the others.
    states, running = cluster({"n1": 6, "n2": 6})
    assert defragment(pod("big", gpus=8), states, fresh(states), facts(states), running,
                      BINPACK) is None  # fmt: skip


def test_no_plan_when_the_pod_fits_or_was_not_tried_or_is_a_gang() -> None:
    states, running = cluster({"n1": 6, "n2": 0, "n3": 6})
    assert defragment(pod("p", gpus=8), states, fresh(states), facts(states), running,
                      BINPACK) is None  # fits n2 now: the scheduler will place it  # fmt: skip
    states, running = cluster({"n1": 6, "n2": 6, "n3": 6, "n4": 6})
    for p in (pod("p", gpus=8, unschedulable=False), pod("p", gpus=8, gang="ml/train")):
        assert defragment(p, states, fresh(states), facts(states), running, BINPACK) is None


def test_only_opted_in_owned_lower_priority_pods_move() -> None:
    base, _ = cluster({"n1": 6, "n2": 6, "n3": 6, "n4": 6})
    for bad in (
        {"opted_in": False},
        {"owned": False},
        {"priority": 100},
        {"unjudgeable": "it has required podAntiAffinity"},
        {"terminating": True},
    ):
        running = {
            n: [pod(f"{n}-p{i}", n, **bad) for i in range(6)] for n in ("n1", "n2", "n3", "n4")
        }
        assert defragment(pod("big", gpus=8, priority=10), base, fresh(base), facts(base),
                          running, BINPACK) is None, bad  # fmt: skip
    running = {n: [pod(f"{n}-p{i}", n, priority=10) for i in range(6)] for n in base}
    assert defragment(pod("big", gpus=8, priority=10), base, fresh(base), facts(base), running,
                      BINPACK) is not None  # equal priority may move  # fmt: skip


def test_stale_nodes_are_neither_emptied_nor_filled() -> None:
    states, running = cluster({"n1": 6, "n2": 6, "n3": 6, "n4": 6, "n5": 6})
    plan = defragment(
        pod("big", gpus=8), states, fresh(states, ("n1",)), facts(states), running, BINPACK
    )
    assert plan is not None and plan.node != "n1" and "n1" not in plan.targets
    # With two stale, the other two cannot take six pods: no plan.
    assert defragment(pod("big", gpus=8), states, fresh(states, ("n1", "n2")), facts(states),
                      running, BINPACK) is None  # fmt: skip


def test_node_selectors_and_taints_bind_the_victims_and_the_pending_pod() -> None:
    states, running = cluster({"n1": 6, "n2": 6, "n3": 6, "n4": 6})
    tainted = {n: nf(n, taints=(("gpu", "reserved", "NoSchedule"),)) for n in states}
    tainted["n1"] = nf("n1")
    big = pod("big", gpus=8)
    # Only n1 is open to the pending pod, and its victims cannot go to tainted nodes.
    assert defragment(big, states, fresh(states), tainted, running, BINPACK) is None
    tolerant = {
        n: [pod(p.name, n, tolerations=({"key": "gpu", "operator": "Exists"},))
            for p in ps] for n, ps in running.items()
    }  # fmt: skip
    plan = defragment(big, states, fresh(states), tainted, tolerant, BINPACK)
    assert plan is not None and plan.node == "n1"
    labelled = {n: nf(n, labels={"pool": "a" if n == "n4" else "b"}) for n in states}
    picky = pod("big", gpus=8, node_selector={"pool": "a"})
    plan = defragment(picky, states, fresh(states), labelled, running, BINPACK)
    assert plan is not None and plan.node == "n4"


def test_cpu_must_be_free_too() -> None:
    states, running = cluster({"n1": 6, "n2": 6, "n3": 6, "n4": 6})
    big = PodFacts(uid="u", namespace="ml", name="big", node="",
                   shape=PodShape(8, cpu_milli=100_000), unschedulable=True)  # fmt: skip
    assert defragment(big, states, fresh(states), facts(states), running, BINPACK) is None


# -- parsing ------------------------------------------------------------------------------


def pod_obj(**meta: Any) -> dict[str, Any]:
    spec = meta.pop("spec", {})
    return {
        "metadata": {"uid": "u1", "name": "p", "namespace": "ml", **meta},
        "spec": {
            "nodeName": "n1",
            "containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "2"}}}],
            **spec,
        },
        "status": {"phase": "Running"},
    }


def test_pod_facts_reads_owner_opt_in_priority_and_affinity() -> None:
    never = lambda labels: False  # noqa: E731
    rs = [{"kind": "ReplicaSet", "name": "r", "controller": True}]
    p = pod_facts(pod_obj(ownerReferences=rs, annotations={"gpudaemon.io/rebalance": "true"},
                          spec={"priority": 5}), PRODUCT, never)  # fmt: skip
    assert p is not None and p.owned and p.opted_in and p.priority == 5 and p.shape.gpus == 2
    assert p.key == "ml/p" and p.node == "n1" and not p.terminating
    bare = pod_facts(pod_obj(ownerReferences=[{"kind": "X", "name": "x"}]), PRODUCT, never)
    assert bare is not None and not bare.owned and not bare.opted_in
    by_label = pod_facts(pod_obj(labels={"team": "a"}), PRODUCT, lambda lab: "team" in lab)
    assert by_label is not None and by_label.opted_in
    product_only = {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [
                {"matchExpressions": [{"key": PRODUCT, "operator": "In", "values": ["H100"]}]}
            ]
        }
    }
    zone = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}  # fmt: skip
    p1 = pod_facts(pod_obj(spec={"affinity": {"nodeAffinity": product_only}}), PRODUCT, never)
    p2 = pod_facts(pod_obj(spec={"affinity": {"nodeAffinity": zone}}), PRODUCT, never)
    assert p1 is not None and p1.fit.node_terms is not None and not p1.cannot_judge
    assert p2 is not None and p2.fit.node_terms is not None and not p2.cannot_judge
    going = pod_facts(pod_obj(deletionTimestamp="2026-01-01T00:00:00Z"), PRODUCT, never)
    assert going is not None and going.terminating


def test_unreadable_resources_give_no_facts() -> None:
    bad = pod_obj()
    bad["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "lots"
    assert pod_facts(bad, PRODUCT, lambda lab: False) is None


def test_node_facts_keep_scheduling_taints_only() -> None:
    f = node_facts({"metadata": {"labels": {"a": "b"}}, "spec": {"taints": [
        {"key": "k", "value": "v", "effect": "NoSchedule"},
        {"key": "soft", "effect": "PreferNoSchedule"}]}})  # fmt: skip
    assert f.labels == {"a": "b"} and f.taints == (("k", "v", "NoSchedule"),)
    assert not may_land(pod("x"), f)
    assert may_land(pod("x", tolerations=({"key": "k", "value": "v"},)), f)
    assert not may_land(pod("x"), None)
