"""Filter rules, policies and score levels are pure: tables of node state and pod."""

from __future__ import annotations

import pytest

from gpudaemon.extender.policies import BinPack, Spread
from gpudaemon.extender.scoring import best, check_node, to_levels
from gpudaemon.extender.state import NodeState, PodShape


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
