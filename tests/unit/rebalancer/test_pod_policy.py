"""The rebalancer scores each pod by that pod's own policy, by the extender's rule (one
implementation, cluster/policies/choice.py): its gpudaemon.io/policy annotation, else
migpack for a pod of MIG devices alone, else `extender.policy`. A pod whose annotation
names no registered policy is placed nowhere by the extender, so the rebalancer
neither moves it nor makes room for it, and says why."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from gpudaemon.cluster.podspec import MAX_POLICY_NAME, POLICY_ANNOTATION, kept_pod
from gpudaemon.cluster.policies import (
    UnknownPodPolicy,
    build_policies,
    choose_policy,
)
from gpudaemon.cluster.state import PodShape
from gpudaemon.config import Config, ExtenderConfig
from gpudaemon.rebalancer.app import Rebalancer
from gpudaemon.rebalancer.planner import Placer, PodFacts, defragment, pod_facts
from tests.clock import FakeClock
from tests.unit.rebalancer.fake_kube import FakeKube
from tests.unit.rebalancer.test_planner import BINPACK, PRODUCT, facts, fresh, pod
from tests.unit.rebalancer.test_profile import three_nodes
from tests.unit.rebalancer.test_rebalancer import load, metric, node
from tests.unit.rebalancer.test_rebalancer import pod as pod_obj

POLICIES = build_policies(ExtenderConfig())


@pytest.mark.parametrize(
    ("annotation", "shape", "expected"),
    [
        (None, PodShape(4), "binpack"),  # the default
        ("spread", PodShape(4), "spread"),
        ("spread", PodShape(0, mig=(("1g.10gb", 1),)), "spread"),  # the annotation wins
        (None, PodShape(0, mig=(("1g.10gb", 1),)), "migpack"),  # MIG devices alone
        (None, PodShape(1, mig=(("1g.10gb", 1),)), "binpack"),  # whole GPUs too
    ],
)
def test_the_rule_that_picks_a_pods_policy(
    annotation: str | None, shape: PodShape, expected: str
) -> None:
    assert choose_policy(annotation, shape, POLICIES, POLICIES["binpack"]).name == expected


def test_an_unknown_policy_is_an_error_naming_the_known_ones() -> None:
    with pytest.raises(UnknownPodPolicy, match=r"unknown policy 'tightest'.*known: binpack"):
        choose_policy("tightest", PodShape(1), POLICIES, POLICIES["binpack"])


def annotated(p: PodFacts, policy: str) -> PodFacts:
    return replace(p, policy=policy)


def plan_for(
    running: dict[str, list[PodFacts]], pending: PodFacts | None = None
) -> tuple[str, tuple[str, ...], tuple[str, ...]] | None:
    """(node emptied, victims, their new nodes) of the plan for an 8-GPU pod, with
    every registered policy known and binpack the default."""
    states, _ = three_nodes()
    ok, f = fresh(states), facts(states)
    big = pending or pod("big", gpus=8)
    placer = Placer(states, ok, f, BINPACK, running, policies=POLICIES)
    plan = defragment(big, states, ok, f, running, BINPACK, placer)
    if plan is None:
        return None
    return plan.node, tuple(v.name for v in plan.victims), plan.targets


def test_a_victim_annotated_spread_goes_where_spread_ranks_first() -> None:
    """n1's 4-GPU pod: binpack (the default) puts it on n2, the fuller node; annotated
    `spread`, the extender puts it on n3, so the plan must count on n3."""
    _, running = three_nodes()
    assert plan_for(running) == ("n1", ("n1-p0",), ("n2",))
    running["n1"] = [annotated(running["n1"][0], "spread")]
    assert plan_for(running) == ("n1", ("n1-p0",), ("n3",))


def test_a_victim_whose_policy_is_unknown_is_not_moved() -> None:
    """The extender fails every node for it: its replacement would stay pending. The
    plan empties n3 instead (two 1-GPU pods, to n1 by binpack: as full as n2, and
    first by name)."""
    _, running = three_nodes()
    running["n1"] = [annotated(running["n1"][0], "tightest")]
    assert plan_for(running) == ("n3", ("n3-p0", "n3-p1"), ("n1", "n1"))


def test_no_room_is_made_for_a_pod_whose_policy_is_unknown() -> None:
    _, running = three_nodes()
    big = annotated(pod("big", gpus=8), "tightest")
    assert plan_for(running, big) is None
    states, _ = three_nodes()
    placer = Placer(states, fresh(states), facts(states), BINPACK, running, policies=POLICIES)
    refusal = placer.refusal(big)
    assert refusal is not None and refusal.reason == "unknown_policy"
    assert "unknown policy 'tightest'" in refusal.message
    assert placer.ranked(big) == []  # as the extender: no node passes


def test_the_pods_kept_form_keeps_its_policy_bounded() -> None:
    obj = pod_obj("a", "n1")
    obj["metadata"]["annotations"] = {POLICY_ANNOTATION: "spread"}
    got = pod_facts(kept_pod(obj), PRODUCT, lambda labels: False)
    assert got is not None and got.policy == "spread"
    obj["metadata"]["annotations"] = {POLICY_ANNOTATION: "x" * 100_000}
    got = pod_facts(kept_pod(obj), PRODUCT, lambda labels: False)
    assert got is not None and got.policy is not None
    assert len(got.policy) <= MAX_POLICY_NAME + 3
    assert got == pod_facts(obj, PRODUCT, lambda labels: False)


# -- end to end -----------------------------------------------------------------------


def with_policy(obj: dict[str, Any], policy: str) -> dict[str, Any]:
    obj["metadata"].setdefault("annotations", {})[POLICY_ANNOTATION] = policy
    return obj


NODES = [node("n1"), node("n2"), node("n3")]


def rig(apply: bool = False) -> tuple[Rebalancer, FakeKube, FakeClock]:
    """A leading rebalancer whose `extender.policy` is binpack."""
    kube, clock = FakeKube(), FakeClock()
    cfg = Config.model_validate({
        "node_name": "test",
        "rebalance": {"dry_run": not apply, "grace_s": 60},
        "extender": {"policy": "binpack"},
    })  # fmt: skip
    rb = Rebalancer(cfg, "rb-a", client=kube, registry=CollectorRegistry(),  # type: ignore[arg-type]
                    clock=clock, wall=clock)  # fmt: skip
    assert rb.elector.try_acquire_or_renew()
    return rb, kube, clock


def running_objs(victim_policy: str | None) -> list[dict[str, Any]]:
    """As `three_nodes`: n1 one 4-GPU pod, n2 four 1-GPU pods, n3 two."""
    victim = pod_obj("n1-p0", "n1", gpus=4)
    if victim_policy is not None:
        with_policy(victim, victim_policy)
    return [victim, *(pod_obj(f"n2-p{i}", "n2") for i in range(4)),
            *(pod_obj(f"n3-p{i}", "n3") for i in range(2))]  # fmt: skip


@pytest.mark.parametrize(("victim_policy", "target"), [(None, "n2"), ("spread", "n3")])
def test_the_rebalancer_places_a_victim_by_its_annotation(
    victim_policy: str | None, target: str
) -> None:
    rb, kube, clock = rig()
    load(rb, clock, NODES, running_objs(victim_policy),
         [pod_obj("big", gpus=8, unschedulable=True)])  # fmt: skip
    rb.run_pass()
    [told] = [e["message"] for e in kube.events if e["reason"] == "RebalanceDefragment"]
    assert "room on n1" in told and f"fits now on: {target}" in told


def test_the_rebalancer_says_why_it_makes_no_room_for_a_pod_of_an_unknown_policy() -> None:
    rb, kube, clock = rig(apply=True)
    big = with_policy(pod_obj("big", gpus=8, unschedulable=True), "tightest")
    load(rb, clock, NODES, running_objs(None), [big])
    rb.run_pass()
    assert [k for k, dry in kube.evictions if not dry] == []
    [told] = [e["message"] for e in kube.events if e["reason"] == "RebalanceSkipped"]
    assert "unknown policy 'tightest'" in told
    assert metric(rb, "gpudaemon_rebalancer_skipped_total", kind="defrag",
                  reason="unknown_policy") == 1  # fmt: skip
