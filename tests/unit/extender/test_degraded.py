"""Healthy GPUs before degraded ones (issue 30): a node that can give a new pod enough
free GPUs that are not degraded ranks above one that would have to use a degraded GPU,
whatever the policy's order; within each group, the policy orders as before. A score,
not a filter: a degraded GPU still takes a pod when nothing better is left. With no
free degraded GPU among the ranked nodes, every answer is the one from before."""

from __future__ import annotations

import json
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from gpudaemon.cluster.clusterstate import ClusterState
from gpudaemon.cluster.policies import build_policies
from gpudaemon.cluster.scoring import Gang, best_nodes, gang_scores, prefer_healthy, to_levels
from gpudaemon.cluster.state import NodeState, PodShape
from gpudaemon.config import Config, ExtenderConfig, load_config
from gpudaemon.extender.api import ExtenderApi
from tests.clock import FakeClock
from tests.unit.extender.test_api import call
from tests.unit.extender.test_cluster import lease_obj, node_obj, pod_obj

P = "gpudaemon.io/"
BINPACK = build_policies(ExtenderConfig())["binpack"]


def gpus_annotation(states: list[str], pods: dict[int, list[str]] | None = None) -> str:
    """The agent's `gpus` annotation: one entry per GPU in `states`; `pods`: holders."""
    out = []
    for i, s in enumerate(states):
        e: dict[str, Any] = {"index": i, "uuid": f"GPU-{i}", "memory_total_mib": 81559,
                             "healthy": s != "unhealthy", "state": s,
                             "action": {"healthy": "none", "degraded": "watch"}.get(s, "reset_gpu")}  # fmt: skip
        if s != "healthy":
            e["reason"] = "clock event hw_slowdown" if s == "degraded" else "row remap pending"
        if pods and i in pods:
            e["pods"] = pods[i]
        out.append(e)
    return json.dumps(out)


def node(name: str, states: list[str], pods: dict[int, list[str]] | None = None) -> dict[str, Any]:
    o = node_obj(name, gpus=len(states), uid=name,
                 healthy=sum(s != "unhealthy" for s in states))  # fmt: skip
    o["metadata"]["annotations"][P + "gpus"] = gpus_annotation(states, pods)
    return o


H, D, U = "healthy", "degraded", "unhealthy"


# -- what a node state holds -----------------------------------------------------------


@pytest.mark.parametrize(
    ("states", "pods", "degraded_free"),
    [
        ([H] * 8, None, 0),
        ([D, H, H, H], None, 1),
        ([D, D, H, H], {0: ["ml/a"]}, 1),  # the held one is not free
        ([D, D], {0: ["ml/a"], 1: ["ml/b"]}, 0),
        ([U, D, H], None, 1),  # the unhealthy one is subtracted elsewhere
        ([D] * 8, None, 8),
    ],
)
def test_a_node_state_counts_its_free_degraded_gpus(
    states: list[str], pods: dict[int, list[str]] | None, degraded_free: int
) -> None:
    c = ClusterState(P)
    c.replace_nodes([node("n", states, pods)])
    st = c.states(["n"])["n"]
    assert st is not None and st.bad_data == ""
    assert st.gpus_degraded_free == degraded_free
    assert c.snapshot(["n"]).degraded == (frozenset({"n"}) if degraded_free else frozenset())


def test_an_older_agents_annotation_has_no_degraded_gpus() -> None:
    c = ClusterState(P)
    c.replace_nodes([node_obj("old", util=[10] * 8)])  # no `state`: healthy follows
    st = c.states(["old"])["old"]
    assert st is not None and st.gpus_degraded_free == 0 and c.snapshot(["old"]).degraded == set()


def test_a_contradicting_state_makes_the_node_unreadable_not_degraded() -> None:
    """The annotation's own bounded decoder judges `state`: all or nothing."""
    c = ClusterState(P)
    bad = node("n", [D, H])
    entries = json.loads(bad["metadata"]["annotations"][P + "gpus"])
    entries[0]["healthy"] = False  # "degraded" and not healthy: a lie or a bug
    bad["metadata"]["annotations"][P + "gpus"] = json.dumps(entries)
    c.replace_nodes([bad])
    st = c.states(["n"])["n"]
    assert st is not None and st.bad_data and st.gpus_degraded_free == 0
    assert c.snapshot(["n"]).degraded == set()


def test_the_degraded_set_follows_node_events() -> None:
    c = ClusterState(P)
    c.replace_nodes([node("a", [D, H]), node("b", [H, H])])
    assert c.snapshot(["a", "b"]).degraded == {"a"}
    c.node_event("MODIFIED", node("a", [H, H]))
    c.node_event("MODIFIED", node("b", [H, D]))
    assert c.snapshot(["a"]).degraded == {"b"}  # of every node, not only those named
    c.node_event("DELETED", node("b", [H, D]))
    assert c.snapshot(["a", "b"]).degraded == set()


# -- the preference, as a pure function ------------------------------------------------


def st(name: str, free: int, degraded: int, total: int = 8) -> NodeState:
    return NodeState(name, gpu_model="NVIDIA-H100", gpus_allocatable=total,
                     gpus_requested=total - free, gpus_total=total, gpus_degraded_free=degraded,
                     cpu_allocatable_milli=64_000, memory_allocatable_bytes=256 << 30)  # fmt: skip


# (node, free GPUs of 8, of them degraded)
NODES = [("a", 2, 2), ("b", 4, 1), ("c", 8, 0), ("d", 3, 0), ("e", 1, 1)]


@pytest.mark.parametrize(
    ("gpus", "order"),
    [
        # binpack alone: e a d b c. a and e have only degraded GPUs free.
        (1, ["d", "b", "c", "e", "a"]),
        # b has 3 clean of 4 free: enough for 3, not for 4.
        (3, ["d", "b", "c"]),
        (4, ["c", "b"]),
        (2, ["d", "b", "c", "a"]),
    ],
)
def test_enough_clean_gpus_rank_first_then_the_policy_orders(gpus: int, order: list[str]) -> None:
    states: dict[str, NodeState | None] = {n: st(n, f, d) for n, f, d in NODES}
    degraded = {n for n, _, d in NODES if d}
    pod = PodShape(gpus)
    raw = {n: BINPACK.raw_score(s, pod) for n, s in states.items() if s and s.can_host(pod)}
    ranked = prefer_healthy(raw, states, degraded, gpus)
    assert best_nodes(ranked, len(order)) == order


@pytest.mark.parametrize(
    ("degraded", "gpus"),
    [
        (set(), 1),  # no degraded GPU anywhere
        ({"z"}, 1),  # only on a node not in the request
        ({"a"}, 0),  # a pod of MIG devices alone: no whole GPU to prefer
    ],
)
def test_nothing_changes_without_a_ranked_degraded_node(degraded: set[str], gpus: int) -> None:
    states: dict[str, NodeState | None] = {n: st(n, f, d) for n, f, d in NODES}
    raw = {n: BINPACK.raw_score(s, PodShape(1)) for n, s in states.items() if s}
    assert prefer_healthy(raw, states, degraded, gpus) is raw


def test_every_node_clean_keeps_the_policys_levels() -> None:
    """Degraded GPUs that are not needed (enough clean ones on every node) change
    neither the pick nor a level."""
    states: dict[str, NodeState | None] = {
        "a": st("a", 4, 1),
        "b": st("b", 6, 2),
        "c": st("c", 8, 0),
    }
    raw = {n: BINPACK.raw_score(s, PodShape(2)) for n, s in states.items() if s}
    assert to_levels(prefer_healthy(raw, states, {"a", "b"}, 2)) == to_levels(raw)


def test_health_comes_before_a_gangs_tiers() -> None:
    """A gang runs at its slowest member's speed: a degraded GPU on the node holding
    the gang is still the worse place for the next member."""
    states: dict[str, NodeState | None] = {"held": st("held", 4, 4), "other": st("other", 8, 0)}
    raw = {n: BINPACK.raw_score(s, PodShape(1)) for n, s in states.items() if s}
    gang = Gang(held={"held"}, products=frozenset({"NVIDIA-H100"}), gpus_to_place=1, pod_gpus=1)
    tiers = gang_scores(raw, states, gang)
    assert best_nodes(tiers, 2) == ["held", "other"]
    assert best_nodes(prefer_healthy(tiers, states, {"held"}, 1), 2) == ["other", "held"]


# -- through the extender's API ---------------------------------------------------------


def api(nodes: list[dict[str, Any]], used: dict[str, int], cfg: Config | None = None,
        candidates: int = 2) -> ExtenderApi:  # fmt: skip
    cfg = cfg or load_config(None, environ={})
    wall = FakeClock()
    c = ClusterState(P, wall=wall)
    c.replace_nodes(nodes)
    c.replace_pods([pod_obj(f"x-{n}", n, k, phase="Running") for n, k in used.items()])
    c.replace_leases([lease_obj(o["metadata"]["name"], wall(), 300, o["metadata"]["uid"])
                      for o in nodes])  # fmt: skip
    from gpudaemon.extender.app import make_policies

    return ExtenderApi(c, make_policies(cfg), "binpack", CollectorRegistry(), lambda: (True, "ok"),
                       candidates=candidates,
                       prefer_healthy_gpus=cfg.extender.prefer_healthy_gpus)  # fmt: skip


def answers(a: ExtenderApi, gpus: int, names: list[str]) -> tuple[list[str], dict[str, int]]:
    body = json.dumps({"Pod": pod_obj("", "", gpus), "NodeNames": names}).encode()
    code, filtered = call(a, "/filter", body)
    assert code.startswith("200"), filtered
    code, res = call(a, "/prioritize", body)
    assert code.startswith("200"), res
    return filtered["NodeNames"], {r["Host"]: r["Score"] for r in res}


# full: 6 of 8 GPUs used, both free ones degraded (binpack's pick without the
# preference); half: 4 used, all healthy; empty: nothing used.
HEALTH_NODES = [
    node("full", [H] * 6 + [D, D], {i: [f"ml/p{i}"] for i in range(6)}),
    node("half", [H] * 8),
    node("empty", [H] * 8),
]
USED = {"full": 6, "half": 4}
NAMES = ["full", "half", "empty"]


def test_a_new_pod_goes_to_a_healthy_gpus_node_over_a_degraded_ones() -> None:
    narrowed, scores = answers(api(HEALTH_NODES, USED), 1, NAMES)
    assert narrowed == ["half", "empty"]  # candidates=2: the degraded node is outranked
    assert scores == {"half": 10, "empty": 9, "full": 8}  # still ranked: a score, not a filter


def test_when_only_degraded_gpus_fit_the_pod_still_goes() -> None:
    narrowed, scores = answers(api(HEALTH_NODES, USED), 2, ["full"])
    assert narrowed == ["full"] and scores == {"full": 10}


def test_switched_off_the_answers_are_the_policys_alone() -> None:
    cfg = load_config(None, environ={}, overrides={"extender": {"prefer_healthy_gpus": False}})
    narrowed, scores = answers(api(HEALTH_NODES, USED, cfg), 1, NAMES)
    assert narrowed == ["full", "half"]
    assert scores == {"full": 10, "half": 9, "empty": 8}


@pytest.mark.parametrize("gpus", [1, 2])
def test_degraded_gpus_that_pods_hold_change_no_answer(gpus: int) -> None:
    """The recorded answers (test_gang) hold when no free GPU is degraded: here the
    degraded GPUs are held, so the answers equal those of an all-healthy cluster."""
    held = [node("full", [D] * 6 + [H, H], {i: [f"ml/p{i}"] for i in range(6)}), *HEALTH_NODES[1:]]
    clean = [node("full", [H] * 8), *HEALTH_NODES[1:]]
    for candidates in (0, 2):
        assert answers(api(held, USED, candidates=candidates), gpus, NAMES) == answers(
            api(clean, USED, candidates=candidates), gpus, NAMES
        )


def test_the_preference_is_on_by_default() -> None:
    assert ExtenderConfig().prefer_healthy_gpus is True
