"""The rebalancer makes room only for a pod that will then fit (issue 28): a pending pod
that asks for a resource, label or toleration no node has, one whose placement the
caches cannot foresee, one of a namespace not served, or of another scheduler, gets
no evictions (a skip reason, and an Event where it is served); the legitimate pod still
gets its room; a pod that stays unschedulable after its room was made backs off."""

from __future__ import annotations

from typing import Any

import pytest

from gpudaemon.cluster.state import NodeState
from gpudaemon.config import Config
from gpudaemon.errors import ConfigError
from gpudaemon.rebalancer.app import Rebalancer
from gpudaemon.rebalancer.passes import MAX_BACKOFF_PODS, ROOM_BACKOFF_S
from gpudaemon.rebalancer.planner import Placer, defragment
from tests.unit.rebalancer.test_planner import BINPACK, cluster, facts, fresh, nf
from tests.unit.rebalancer.test_planner import pod as pfacts
from tests.unit.rebalancer.test_rebalancer import load, metric, node, pod, rig

SKIPPED = "gpudaemon_rebalancer_skipped_total"


def fragmented() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Four 8-GPU nodes with six opted-in 1-GPU pods each: an 8-GPU pod fits nowhere
    until one node's pods move."""
    nodes = [node(f"n{i}") for i in range(1, 5)]
    running = [pod(f"n{i}-p{j}", f"n{i}") for i in range(1, 5) for j in range(6)]
    return nodes, running


def big(name: str = "big", namespace: str = "ml", **spec: Any) -> dict[str, Any]:
    p = pod(name, gpus=8, unschedulable=True)
    p["metadata"]["namespace"] = namespace
    p["metadata"]["uid"] = f"uid-{namespace}-{name}"
    for k, v in spec.items():
        if k == "requests":
            p["spec"]["containers"][0]["resources"]["requests"].update(v)
        else:
            p["spec"][k] = v
    return p


def taint_all(nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for n in nodes:
        n["spec"] = {"taints": [{"key": "gpu", "value": "team-a", "effect": "NoSchedule"}]}
    return nodes


def pass_once(
    pending: dict[str, Any], nodes: list[dict[str, Any]] | None = None, **rebalance: Any
) -> tuple[Rebalancer, Any]:
    base_nodes, running = fragmented()
    rb, kube, clock = rig(apply=True, **rebalance)
    load(rb, clock, nodes or base_nodes, running, [pending])
    rb.run_pass()
    return rb, kube


ANTI = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
    {"topologyKey": "kubernetes.io/hostname",
     "labelSelector": {"matchLabels": {"app": "big"}}}]}}  # fmt: skip
NOT_TOLERATED = [{"key": "gpu", "value": "team-b", "effect": "NoSchedule"}]


@pytest.mark.parametrize(
    ("pending", "nodes", "reason", "words"),
    [
        (big(requests={"example.com/foo": "1"}), None, "never_fits", "example.com/foo"),
        (big(nodeSelector={"pool": "nowhere"}), None, "never_fits", "nodeSelector pool"),
        (big(tolerations=NOT_TOLERATED), taint_all(fragmented()[0]), "never_fits",
         "taint gpu=team-a:NoSchedule"),
        (big(requests={"memory": "300Gi"}), None, "never_fits", "memory"),
        (big(affinity=ANTI), None, "cannot_judge", "podAntiAffinity"),
        (big(topologySpreadConstraints=[{"maxSkew": 1, "topologyKey": "zone",
                                         "whenUnsatisfiable": "DoNotSchedule",
                                         "labelSelector": {}}]), None, "cannot_judge",
         "topology spread"),
    ],
)  # fmt: skip
def test_a_pod_that_would_not_then_fit_gets_no_evictions(
    pending: dict[str, Any], nodes: list[dict[str, Any]] | None, reason: str, words: str
) -> None:
    rb, kube = pass_once(pending, nodes)
    assert kube.evictions == [] and kube.patches == []
    assert metric(rb, SKIPPED, kind="defrag", reason=reason) == 1
    [ev] = kube.events
    assert ev["reason"] == "RebalanceSkipped" and ev["involvedObject"]["name"] == "big"
    assert words in ev["message"], ev["message"]
    rb.run_pass()  # told once, not every pass
    assert len(kube.events) == 1 and metric(rb, SKIPPED, kind="defrag", reason=reason) == 1


def test_the_legitimate_pod_still_gets_room_and_its_tolerated_taint_is_no_bar() -> None:
    rb, kube = pass_once(big(requests={"memory": "16Gi"}))
    assert len([k for k, dry in kube.evictions if not dry]) == 6
    tolerant = [{"key": "gpu", "operator": "Exists"}]
    nodes, running = fragmented()
    for p in running:
        p["spec"]["tolerations"] = tolerant
    rb, kube, clock = rig(apply=True)
    load(rb, clock, taint_all(nodes), running, [big(tolerations=tolerant)])
    rb.run_pass()
    assert len([k for k, dry in kube.evictions if not dry]) == 6


def test_a_namespace_not_served_gets_no_evictions_and_no_event() -> None:
    rb, kube = pass_once(big(namespace="tenant-b"), namespaces=["ml", "team-a"])
    assert kube.evictions == [] and kube.events == [] and kube.patches == []
    assert metric(rb, SKIPPED, kind="defrag", reason="namespace") == 1
    rb, kube = pass_once(big(namespace="team-a"), namespaces=["ml", "team-a"])
    assert len([k for k, dry in kube.evictions if not dry]) == 6


def test_another_schedulers_pod_is_not_made_room_for() -> None:
    rb, kube = pass_once(big(schedulerName="default-scheduler"))
    assert kube.evictions == [] and kube.events == []
    assert metric(rb, SKIPPED, kind="defrag", reason="scheduler") == 1


def test_rebalance_namespaces_and_scheduler_name_are_checked_at_load() -> None:
    ok = Config.model_validate({"node_name": "x", "rebalance": {"namespaces": ["ml", "a-1"]}})
    assert ok.rebalance.namespaces == ["ml", "a-1"]
    for bad in (["ML"], ["a_b"], ["-a"], ["x" * 64], "ml"):
        with pytest.raises((ConfigError, ValueError)):
            Config.model_validate({"node_name": "x", "rebalance": {"namespaces": bad}})
    with pytest.raises((ConfigError, ValueError)):
        Config.model_validate({"node_name": "x", "rebalance": {"scheduler_name": "a,spec.x="}})


def test_a_pod_still_unschedulable_after_its_room_backs_off_exponentially() -> None:
    nodes, running = fragmented()
    rb, kube, clock = rig(apply=True, interval_s=30)
    pending = big()

    def plans() -> int:
        return len([k for k, dry in kube.evictions if not dry]) // 6

    load(rb, clock, nodes, running, [pending])
    rb.run_pass()
    assert plans() == 1
    # Its replacements landed elsewhere, yet it stays unschedulable (as if another pod
    # took the room): the cluster looks fragmented again.
    clock.advance(61)
    load(rb, clock, nodes, running, [pending])
    rb.run_pass()
    assert plans() == 1 and metric(rb, SKIPPED, kind="defrag", reason="backoff") == 1
    assert "still unschedulable" in kube.events[-1]["message"]
    clock.advance(ROOM_BACKOFF_S - 61 - 1)
    rb._pending_replace([pending])
    rb.run_pass()
    assert plans() == 1
    clock.advance(2)
    load(rb, clock, nodes, running, [pending])
    rb.run_pass()
    assert plans() == 2  # after 10 min: once more
    clock.advance(ROOM_BACKOFF_S + 1)
    load(rb, clock, nodes, running, [pending])
    rb.run_pass()
    assert plans() == 2  # then 20 min
    clock.advance(ROOM_BACKOFF_S)
    load(rb, clock, nodes, running, [pending])
    rb.run_pass()
    assert plans() == 3
    # A pod no longer pending is forgotten; the map never exceeds its bound.
    rb._pending_replace([])
    rb.run_pass()
    assert rb.passes.made_room_for == {} and rb.passes.room_tries == {}
    for i in range(MAX_BACKOFF_PODS + 5):
        rb.passes.made_room_for[f"u{i}"] = float(i)
    rb.passes.forget_rooms({f"u{i}" for i in range(MAX_BACKOFF_PODS + 5)})
    assert len(rb.passes.made_room_for) == MAX_BACKOFF_PODS and "u0" not in rb.passes.made_room_for


# -- the planner on its own ----------------------------------------------------------------


def test_the_planner_makes_no_plan_for_what_no_node_has() -> None:
    """Each without the filters' checks would get the plan the plain pod gets."""
    states, running = cluster({"n1": 6, "n2": 6, "n3": 6, "n4": 6})
    f = facts(states)
    assert defragment(pfacts("big", gpus=8), states, fresh(states), f, running,
                      BINPACK) is not None  # fmt: skip
    tainted = {n: nf(n, taints=(("gpu", "a", "NoSchedule"),)) for n in states}
    cases = [
        (pfacts("big", gpus=8, extra={"example.com/foo": 1}), f, "never_fits"),
        (pfacts("big", gpus=8, node_selector={"pool": "x"}), f, "never_fits"),
        (pfacts("big", gpus=8, tolerations=({"key": "gpu", "value": "b"},)), tainted,
         "never_fits"),
        (pfacts("big", gpus=8, unjudgeable="it has required podAntiAffinity"), f,
         "cannot_judge"),
    ]  # fmt: skip
    for pending, nodes, reason in cases:
        placer = Placer(states, fresh(states), nodes, BINPACK, running)
        assert defragment(pending, states, fresh(states), nodes, running, BINPACK) is None
        refused = placer.refusal(pending)
        assert refused is not None and refused.reason == reason, pending


def test_a_resource_left_short_after_the_evictions_means_no_plan() -> None:
    """Every node has one `example.com/foo`, held by a pod that may not move: the GPUs
    could be freed, the device not."""
    states, running = cluster({"n1": 6, "n2": 6, "n3": 6, "n4": 6})
    alloc = {"nvidia.com/gpu": 8, "cpu": 64_000, "memory": 256 << 30, "pods": 110,
             "example.com/foo": 1}  # fmt: skip
    f = {n: nf(n, allocatable=alloc) for n in states}
    for n in states:
        running[n].append(pfacts(f"{n}-foo", n, 0, opted_in=False, extra={"example.com/foo": 1}))
    pending = pfacts("big", gpus=8, extra={"example.com/foo": 1})
    assert Placer(states, fresh(states), f, BINPACK, running).refusal(pending) is None
    assert defragment(pending, states, fresh(states), f, running, BINPACK) is None
    # One node's holder goes: room is made there, and only there.
    running["n3"] = [p for p in running["n3"] if p.name != "n3-foo"]
    plan = defragment(pending, states, fresh(states), f, running, BINPACK)
    assert plan is not None and plan.node == "n3"


def test_victims_go_only_where_their_replacements_would_fit() -> None:
    """The victims need `example.com/bar`, which only their own node has: no target."""
    states: dict[str, NodeState | None]
    states, running = cluster({"n1": 6, "n2": 6, "n3": 6, "n4": 6})
    alloc = {"nvidia.com/gpu": 8, "cpu": 64_000, "memory": 256 << 30, "pods": 110}
    f = {n: nf(n, allocatable={**alloc, "example.com/bar": 6} if n == "n1" else alloc)
         for n in states}  # fmt: skip
    running["n1"] = [pfacts(f"n1-p{i}", "n1", extra={"example.com/bar": 1}) for i in range(6)]
    for n in ("n2", "n3", "n4"):
        running[n] = [pfacts(f"{n}-p{i}", n, opted_in=False) for i in range(6)]
    assert defragment(pfacts("big", gpus=8), states, fresh(states), f, running, BINPACK) is None
