"""The rebalancer places a victim by the extender's configured plug-ins (issue 38): the
filters of `extender.plugins.filter` in order, the score plug-ins summed with their
weights as the extender sums them, and the tiers compared first, in their order. So a
plan holds only where the extender would place its pods, whatever the profile."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from gpudaemon.cluster.clusterstate import ClusterState, Snapshot
from gpudaemon.cluster.plugins import (
    CycleState,
    PluginSpec,
    Profile,
    build_profile,
    register,
    unregister,
    weighted_sum,
)
from gpudaemon.cluster.policies import build_policies
from gpudaemon.cluster.state import NodeState
from gpudaemon.config import Config, ExtenderConfig, PluginsConfig
from gpudaemon.rebalancer.app import Rebalancer
from gpudaemon.rebalancer.planner import (
    PlacementHandle,
    Placer,
    PodFacts,
    default_profile,
    defragment,
)
from tests.clock import FakeClock
from tests.unit.rebalancer.fake_kube import FakeKube
from tests.unit.rebalancer.test_planner import BINPACK, facts, fresh, pod, state
from tests.unit.rebalancer.test_rebalancer import load, node
from tests.unit.rebalancer.test_rebalancer import pod as pod_obj

POLICIES = build_policies(ExtenderConfig())


def profile(**plugins: Any) -> Profile:
    """The profile of `extender.plugins` = `plugins`, as the rebalancer builds it."""
    cfg = PluginsConfig.model_validate(plugins)
    return build_profile(cfg, PlacementHandle(ClusterState(), POLICIES))


def plan_for(
    states: dict[str, NodeState | None],
    running: dict[str, list[PodFacts]],
    prof: Profile | None = None,
    degraded: frozenset[str] = frozenset(),
) -> tuple[str, tuple[str, ...]] | None:
    """(the node emptied, each victim's new node) of the plan for an 8-GPU pod."""
    f, ok = facts(states), fresh(states)
    placer = Placer(states, ok, f, BINPACK, running, profile=prof, degraded=degraded)
    plan = defragment(pod("big", gpus=8), states, ok, f, running, BINPACK, placer)
    return None if plan is None else (plan.node, plan.targets)


# -- filters ------------------------------------------------------------------------------


def sick_cluster() -> tuple[dict[str, NodeState | None], dict[str, list[PodFacts]]]:
    """n1: four 1-GPU pods (an 8-GPU pod needs them gone); n2: two pods and one
    unhealthy GPU, 5 GPUs free: the only place they could go."""
    states: dict[str, NodeState | None] = {"n1": state("n1", 4), "n2": state("n2", 2, unhealthy=1)}
    running = {n: [pod(f"{n}-p{i}", n) for i in range(u)] for n, u in (("n1", 4), ("n2", 2))}
    return states, running


def test_with_the_default_filters_no_victim_lands_on_a_node_with_an_unhealthy_gpu() -> None:
    states, running = sick_cluster()
    assert plan_for(states, running) is None
    assert plan_for(states, running, profile()) is None


def test_without_the_healthy_filter_a_victim_lands_where_the_extender_would_put_it() -> None:
    """`extender.plugins.filter` without `healthy`: the extender places pods on a node
    with an unhealthy GPU, so the rebalancer counts that node as room for its victims."""
    states, running = sick_cluster()
    got = plan_for(states, running, profile(filter=["fresh", "gpu_fit", "reserved"]))
    assert got == ("n1", ("n2",) * 4)
    # As `healthy`'s own argument does.
    off = profile(args={"healthy": {"enabled": False}})
    assert plan_for(states, running, off) == ("n1", ("n2",) * 4)


def test_the_filters_run_in_the_configured_profile_only() -> None:
    """A profile without `fresh`: a node whose agent data is stale still takes a
    victim, as the extender would place it there (nothing is evicted from such a
    node: that rule is the rebalancer's own)."""
    states, running = sick_cluster()
    states["n3"] = state("n3", 0)
    ok = fresh(states, stale=("n3",))
    f = facts(states)
    victim = pod("v", gpus=4)
    assert Placer(states, ok, f, BINPACK, running).ranked(victim) == ["n1"]
    no_fresh = profile(filter=["healthy", "gpu_fit"])
    assert Placer(states, ok, f, BINPACK, running, profile=no_fresh).ranked(victim) == [
        "n1",
        "n3",
    ]


# -- scores -------------------------------------------------------------------------------


def three_nodes() -> tuple[dict[str, NodeState | None], dict[str, list[PodFacts]]]:
    """n1: one 4-GPU pod (the cheapest to move for an 8-GPU pod); n2: 4 GPUs free, n3:
    6. binpack puts the 4-GPU pod on n2 (fuller), spread on n3."""
    states: dict[str, NodeState | None] = {
        "n1": state("n1", 4),
        "n2": state("n2", 4),
        "n3": state("n3", 2),
    }
    running = {
        "n1": [pod("n1-p0", "n1", 4)],
        "n2": [pod(f"n2-p{i}", "n2") for i in range(4)],
        "n3": [pod(f"n3-p{i}", "n3") for i in range(2)],
    }
    return states, running


def test_by_the_default_profile_the_victim_goes_where_the_policy_puts_it() -> None:
    states, running = three_nodes()
    assert plan_for(states, running) == ("n1", ("n2",))


@pytest.mark.parametrize(
    ("score", "target"),
    [
        ([{"name": "policy", "weight": 1}, {"name": "spread", "weight": 3}], "n3"),
        ([{"name": "policy", "weight": 3}, {"name": "spread", "weight": 1}], "n2"),
        (["spread"], "n3"),
    ],
)
def test_the_victims_host_follows_the_weighted_sum_of_the_score_plugins(
    score: list[Any], target: str
) -> None:
    states, running = three_nodes()
    assert plan_for(states, running, profile(score=score)) == ("n1", (target,))


def test_the_sum_is_the_extenders_own() -> None:
    """The placer's order is `weighted_sum` of the plug-ins' raw scores over the nodes
    that can take the pod, the extender's rule (one implementation, cluster/plugins)."""
    states, running = three_nodes()
    victim = pod("v", gpus=4)
    score = [{"name": "policy", "weight": 2}, {"name": "spread", "weight": 1}]
    placer = Placer(states, fresh(states), facts(states), BINPACK, running,
                    profile=profile(score=score))  # fmt: skip
    hosts = placer.ranked(victim)
    spread = POLICIES["spread"]
    parts = [
        ({n: BINPACK.raw_score(states[n], victim.shape) for n in hosts}, 2),  # type: ignore[arg-type]
        ({n: spread.raw_score(states[n], victim.shape) for n in hosts}, 1),  # type: ignore[arg-type]
    ]
    total = weighted_sum(parts)
    assert hosts == sorted(hosts, key=lambda n: (-total[n], n))


# -- tiers --------------------------------------------------------------------------------


class Prefer:
    """A tier that puts one node first."""

    def __init__(self, node: str) -> None:
        self.name, self.node = f"prefer_{node}", node

    def has_say(self, state: CycleState, degraded: bool) -> bool:
        return True

    def order(
        self, state: CycleState, scores: Mapping[str, Any], snap: Snapshot
    ) -> Mapping[str, Any]:
        return {n: (n == self.node, v) for n, v in scores.items()}


def prefer(node: str) -> Callable[[Any, Any], Prefer]:
    return lambda handle, args: Prefer(node)


@pytest.fixture
def prefer_tiers() -> Iterator[None]:
    specs = [PluginSpec(f"prefer_{n}", "tier", prefer(n), "test") for n in ("n2", "n3")]
    for s in specs:
        register(s)
    yield
    for s in specs:
        unregister("tier", s.name)


@pytest.mark.usefixtures("prefer_tiers")
@pytest.mark.parametrize(
    ("tiers", "target"),
    [
        (["prefer_n3", "prefer_n2"], "n3"),
        (["prefer_n2", "prefer_n3"], "n2"),
        (["prefer_n3"], "n3"),  # a tier outranks the sum, whatever its weights
    ],
)
def test_the_tiers_are_compared_first_in_their_configured_order(
    tiers: list[str], target: str
) -> None:
    states, running = three_nodes()
    score = [{"name": "policy", "weight": 100}]
    assert plan_for(states, running, profile(tiers=tiers, score=score)) == ("n1", (target,))


def test_a_degraded_gpu_sends_the_victim_to_healthy_gpus_unless_the_tier_is_off() -> None:
    """n2 has a free degraded GPU, so it cannot give the 4-GPU victim 4 GPUs that are
    not degraded: `healthy_gpus` (a default tier) puts n3 first, as the extender would."""
    states, running = three_nodes()
    n2 = states["n2"]
    assert n2 is not None
    states["n2"] = replace(n2, gpus_degraded_free=1)
    assert plan_for(states, running, default_profile(), frozenset({"n2"})) == ("n1", ("n3",))
    no_tiers = profile(tiers=["gang"])
    assert plan_for(states, running, no_tiers, frozenset({"n2"})) == ("n1", ("n2",))


def test_a_node_a_victim_was_placed_on_is_ranked_again_with_the_others() -> None:
    """n1's two 2-GPU pods go. n2 (4 free, one degraded) can give the first 2 clean
    GPUs, and binpack likes it best; after it, n2 has 2 free, one degraded: the tier
    now puts n3 first for the second, as the extender would rank its replacement."""
    states: dict[str, NodeState | None] = {
        "n1": state("n1", 4),
        "n2": state("n2", 4),
        "n3": state("n3", 3),
    }
    running = {
        "n1": [pod("n1-a", "n1", 2), pod("n1-b", "n1", 2)],
        "n2": [pod(f"n2-p{i}", "n2") for i in range(4)],
        "n3": [pod(f"n3-p{i}", "n3") for i in range(3)],
    }
    n2 = states["n2"]
    assert n2 is not None
    states["n2"] = replace(n2, gpus_degraded_free=1)
    degraded = frozenset({"n2"})
    assert plan_for(states, running, default_profile(), degraded) == ("n1", ("n2", "n3"))
    assert plan_for(states, running, profile(tiers=["gang"]), degraded) == ("n1", ("n2", "n2"))


# -- the wiring ---------------------------------------------------------------------------


def rebalancer(plugins: dict[str, Any] | None = None) -> tuple[Rebalancer, FakeKube, FakeClock]:
    kube, clock = FakeKube(), FakeClock()
    cfg = Config.model_validate({
        "node_name": "test",
        "rebalance": {"dry_run": True, "grace_s": 60},
        "extender": {"plugins": plugins or {}},
    })  # fmt: skip
    rb = Rebalancer(cfg, "rb-a", client=kube, registry=CollectorRegistry(),  # type: ignore[arg-type]
                    clock=clock, wall=clock)  # fmt: skip
    assert rb.elector.try_acquire_or_renew()
    return rb, kube, clock


@pytest.mark.parametrize(
    ("plugins", "planned"),
    [
        (None, False),
        ({"filter": ["fresh", "gpu_fit", "reserved"]}, True),
    ],
)
def test_the_rebalancer_runs_the_profile_extender_plugins_configures(
    plugins: dict[str, Any] | None, planned: bool
) -> None:
    """End to end: n2 has an unhealthy GPU (no pod on it) and room for n1's pods."""
    rb, kube, clock = rebalancer(plugins)
    nodes = [node("n1"), node("n2", sick={7: []})]
    running = [pod_obj(f"n1-p{i}", "n1") for i in range(4)]
    running += [pod_obj(f"n2-p{i}", "n2") for i in range(2)]
    load(rb, clock, nodes, running, [pod_obj("big", gpus=8, unschedulable=True)])
    rb.run_pass()
    told = [e["message"] for e in kube.events if e["reason"] == "RebalanceDefragment"]
    if planned:
        assert len(told) == 1 and "room on n1" in told[0] and "fits now on: n2" in told[0]
    else:
        assert told == []


def test_an_unknown_plugin_stops_the_rebalancer_at_start() -> None:
    from gpudaemon.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown filter plug-in 'healthiest'"):
        rebalancer({"filter": ["fresh", "healthiest"]})
