"""Filter rules, policies and score levels are pure: tables of node state and pod."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpudaemon.cluster.policies import BinPack, Spread
from gpudaemon.cluster.scoring import (
    GangScore,
    ScoreMemo,
    best,
    best_nodes,
    check_node,
    to_levels,
)
from gpudaemon.cluster.state import NodeState, PodShape


def node(
    name: str = "n",
    alloc: int = 8,
    used: int = 0,
    unhealthy: int = 0,
    util: float | None = None,
    agent: bool = True,
) -> NodeState:
    return NodeState(name, "H100", alloc, used, unhealthy, 64000, 0, 2**40, 0, util, agent)


@pytest.mark.parametrize(
    ("n", "gpus", "fresh", "reason"),
    [
        (node(), 1, True, None),
        (node(used=7), 1, True, None),
        (node(used=7), 2, True, "insufficient_gpus"),
        (node(), 1, False, "stale"),
        (None, 1, True, "no_agent"),
        (node(agent=False), 1, True, "no_agent"),
        (node(unhealthy=1), 1, True, "unhealthy"),
        # stale wins over unhealthy and capacity: fix the agent first
        (node(used=8, unhealthy=1), 1, False, "stale"),
    ],
)
def test_check_node(n: NodeState | None, gpus: int, fresh: bool, reason: str | None) -> None:
    why = check_node(n, PodShape(gpus), fresh=fresh)
    assert (why.reason if why else None) == reason
    if why:
        assert "\n" not in why.message and why.message


def test_unhealthy_gpus_count_against_capacity_when_not_avoided() -> None:
    n = node(used=6, unhealthy=1)
    assert n.gpus_free == 1
    assert check_node(n, PodShape(1), fresh=True, avoid_unhealthy=False) is None
    why = check_node(n, PodShape(2), fresh=True, avoid_unhealthy=False)
    assert why is not None and why.reason == "insufficient_gpus"


@pytest.mark.parametrize(
    ("a", "b", "gpus", "binpack_prefers"),
    [
        (node("a", used=6), node("b", used=2), 1, "a"),  # fewer left after placement
        (node("a", used=0), node("b", used=4), 4, "b"),  # b is filled exactly
        (node("a", used=4, util=0.9), node("b", used=4, util=0.1), 1, "a"),  # tie: busier wins
        (node("a", alloc=4), node("b", alloc=8), 2, "a"),  # the smaller node is left fuller
    ],
)
def test_binpack_and_spread_order(
    a: NodeState, b: NodeState, gpus: int, binpack_prefers: str
) -> None:
    pod = PodShape(gpus)
    bp, sp = BinPack(), Spread()
    raw_b = {a.name: bp.raw_score(a, pod), b.name: bp.raw_score(b, pod)}
    raw_s = {a.name: sp.raw_score(a, pod), b.name: sp.raw_score(b, pod)}
    assert best(raw_b) == binpack_prefers
    assert best(raw_s) != binpack_prefers


def test_utilization_only_breaks_ties() -> None:
    pod = PodShape(1)
    fuller_idle = node("a", used=6, util=0.0)
    emptier_busy = node("b", used=5, util=1.0)
    bp = BinPack(utilization_weight=0.99)
    assert bp.raw_score(fuller_idle, pod) > bp.raw_score(emptier_busy, pod)


@pytest.mark.parametrize(
    ("raw", "levels"),
    [
        ({}, {}),
        ({"a": 5.0}, {"a": 10}),
        # the pick (ties by name) alone at 10; its equals one level below
        ({"a": -1.0, "b": -3.0, "c": -1.0}, {"a": 10, "c": 9, "b": 8}),
        ({"z": 1.0, "y": 1.0, "x": 1.0}, {"x": 10, "y": 9, "z": 9}),
        # an outlier far below does not squeeze the best together (a linear map would)
        ({"a": 0.0, "b": -0.1, "c": -1000.0}, {"a": 10, "b": 9, "c": 8}),
        # beyond ten tiers everything is 0
        (
            {f"n{i:02d}": float(-i) for i in range(13)},
            {f"n{i:02d}": max(0, 10 - i) for i in range(13)},
        ),
    ],
)
def test_to_levels_keeps_the_best_distinguishable(
    raw: dict[str, float], levels: dict[str, int]
) -> None:
    assert to_levels(raw) == levels


def test_the_pick_is_the_only_node_at_the_top_level() -> None:
    raw = {f"n{i}": float(i % 3) for i in range(30)}
    levels = to_levels(raw)
    assert [n for n, lv in levels.items() if lv == 10] == [best(raw)]


def test_best_breaks_ties_by_node_name() -> None:
    assert best({"b": 1.0, "a": 1.0}) == "a"
    assert best({"b": 2.0, "a": 1.0}) == "b"
    assert best({}) is None


raws = st.dictionaries(
    st.sampled_from([f"n{i:02d}" for i in range(40)]),
    st.sampled_from([-3.0, -2.5, -1.0, 0.0, 0.25, 1.0, 7.0]),  # few values: many ties
)


def _reference_levels(raw: dict[str, float]) -> dict[str, int]:
    """to_levels as first written: rank tiers, the pick alone at 10, ties one below."""
    if not raw:
        return {}
    pick = min(raw, key=lambda n: (-raw[n], n))
    tier = {v: i + 1 for i, v in enumerate(sorted(set(raw.values()), reverse=True))}
    if not any(v == raw[pick] for n, v in raw.items() if n != pick):
        tier = {v: t - 1 for v, t in tier.items()}
    levels = {n: max(0, 10 - tier[v]) for n, v in raw.items()}
    levels[pick] = 10
    return levels


@given(raws)
def test_to_levels_matches_the_reference_rule(raw: dict[str, float]) -> None:
    assert to_levels(raw) == _reference_levels(raw)


@given(raws, st.integers(1, 50))
def test_best_nodes_are_the_k_first_in_best_order(raw: dict[str, float], k: int) -> None:
    expected = sorted(raw, key=lambda n: (-raw[n], n))[:k]
    assert best_nodes(raw, k) == expected
    if raw:
        assert best_nodes(raw, k)[0] == best(raw)


gang_raws = st.dictionaries(
    st.sampled_from([f"n{i:02d}" for i in range(40)]),
    st.tuples(st.booleans(), st.booleans(), st.booleans(), st.sampled_from([-3000.0, -1.0, 0.5])),
)


@given(gang_raws, st.integers(1, 50))
def test_gang_scores_rank_by_the_same_rule_compared_as_tuples(
    raw: dict[str, GangScore], k: int
) -> None:
    """Levels and the filter's narrowing order a gang pod's (tier..., raw) tuples
    element by element, by the rule raw scores follow: the same answers as for floats
    in the tuples' order."""
    position = {v: float(i) for i, v in enumerate(sorted(set(raw.values())))}
    as_floats = {n: position[v] for n, v in raw.items()}
    assert to_levels(raw) == _reference_levels(as_floats)
    assert best_nodes(raw, k) == sorted(raw, key=lambda n: (-as_floats[n], n))[:k]


class CountingPolicy:
    name = "counting"
    scores_gpuless_pods = False

    def __init__(self) -> None:
        self.calls = 0
        self.version = 0

    def scores_version(self) -> object:
        return self.version

    def raw_score(self, node: NodeState, pod: PodShape) -> float:
        self.calls += 1
        return float(-node.gpus_free)


def test_score_memo_reuses_scores_while_the_node_state_object_is_the_same() -> None:
    memo, policy, pod = ScoreMemo(), CountingPolicy(), PodShape(1)
    states: dict[str, NodeState | None] = {"a": node("a"), "b": node("b", used=3)}
    assert memo.scores(policy, pod, ["a", "b"], states) == {"a": -8.0, "b": -5.0}
    assert memo.scores(policy, pod, ["a", "b"], states) == {"a": -8.0, "b": -5.0}
    assert policy.calls == 2 and memo.hits == 2
    # The node changed (a pod landed): its new state is scored, the other is not.
    states["a"] = node("a", used=1)
    assert memo.scores(policy, pod, ["a", "b"], states) == {"a": -7.0, "b": -5.0}
    assert policy.calls == 3
    # What the policy learned moved on: everything is scored again.
    policy.version += 1
    memo.scores(policy, pod, ["a", "b"], states)
    assert policy.calls == 5


def test_score_memo_leaves_out_nodes_that_cannot_host_or_are_unknown() -> None:
    memo, policy = ScoreMemo(), CountingPolicy()
    states: dict[str, NodeState | None] = {"full": node("full", used=8), "gone": None}
    assert memo.scores(policy, PodShape(1), ["full", "gone", "never"], states) == {}
    assert memo.scores(policy, PodShape(1), ["full"], states) == {}
    assert policy.calls == 0


def test_score_memo_keeps_one_memo_per_shape_and_drops_the_least_recent() -> None:
    memo, policy = ScoreMemo(max_shapes=2), CountingPolicy()
    states: dict[str, NodeState | None] = {"a": node("a")}
    for gpus in (1, 2, 1, 3, 1, 2):  # 2 is dropped when 3 arrives; 1 stays in use
        memo.scores(policy, PodShape(gpus), ["a"], states)
    assert policy.calls == 4  # 1, 2, 3, then 2 again
