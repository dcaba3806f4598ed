"""Gang pods (Coscheduling's scheduling.x-k8s.io/pod-group label) in the extender
(issue 21): held while they wait at Permit, released when the scheduler tries them
again, and kept together on as few nodes, of one product, as fit. The gang's
preferences are tiers compared before the policy's raw score (issue 28), and pods
without a gang score exactly as before."""

from __future__ import annotations

import json
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from gpudaemon.cluster.clusterstate import ClusterState
from gpudaemon.cluster.podspec import GANG_LABEL, pod_gang
from gpudaemon.cluster.policies import BinPack, Spread
from gpudaemon.cluster.policies.base import Policy
from gpudaemon.cluster.policies.fragmentation import Fragmentation, TypicalPod, Workload
from gpudaemon.cluster.policies.migpack import MigPack
from gpudaemon.cluster.scoring import Gang, best_nodes, gang_scores, to_levels
from gpudaemon.cluster.state import NodeState, PodShape
from gpudaemon.extender.api import ExtenderApi
from tests.clock import FakeClock
from tests.unit.extender.test_api import call, make_api
from tests.unit.extender.test_cluster import lease_obj, node_obj, pod_obj
from tests.unit.extender.test_fragmentation import fixed
from tests.unit.extender.test_mig import P, mig_node, mig_pod


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
    from gpudaemon.cluster.selectors import unschedulable_since
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


# -- gang tiers: an ordered comparison, then the policy ---------------------------------
#
# A gang pod's score is (same node as the gang, the whole rest of the gang fits, same
# GPU product, the policy's raw score), compared in that order: no policy's spread of
# raw scores can outweigh a tier (as constants added to the raw score once did).

H100, A100 = "NVIDIA-H100", "NVIDIA-A100"


def gpu_node(name: str, model: str, free: int, mig_free: int = 0) -> NodeState:
    """An 8-GPU node (64 cores, 256 GiB) with `free` whole GPUs and 1g MIG devices."""
    return NodeState(
        name,
        model,
        gpus_allocatable=8,
        gpus_requested=8 - free,
        cpu_allocatable_milli=64000,
        memory_allocatable_bytes=256 << 30,
        mig_allocatable=(("1g.10gb", mig_free),) if mig_free else (),
    )


# The gang already holds `g-*` (H100); 6 GPUs of it remain to place (this pod's 2
# included). Tiers: held > whole rest fits (same product, then other) > same product > rest.
TIER_NODES = [
    gpu_node("g-2", H100, 2),  # held
    gpu_node("g-5", H100, 5),  # held
    gpu_node("w-h6", H100, 6),  # the rest of the gang (6) fits, same product
    gpu_node("w-a8", A100, 8),  # fits the rest, other product
    gpu_node("w-a7", A100, 7),  # fits the rest, other product
    gpu_node("p-3", H100, 3),  # same product only
    gpu_node("p-4", H100, 4),  # same product only
    gpu_node("o-2", A100, 2),  # none
    gpu_node("o-5", A100, 5),  # none
]
TIER_GANG = Gang(held={"g-2": 1, "g-5": 1}, products=frozenset({H100}), gpus_to_place=6, pod_gpus=2)
TIERS = [["g-2", "g-5"], ["w-h6"], ["w-a7", "w-a8"], ["p-3", "p-4"], ["o-2", "o-5"]]


def policies() -> dict[str, Policy]:
    return {
        "binpack": BinPack(),
        "spread": Spread(),
        "migpack": MigPack(),
        # 4-GPU pods typical: a node left with 1-3 free GPUs strands them
        "fragmentation": fixed((PodShape(4), 1), nodes=TIER_NODES),
    }


def order(policy: Policy, nodes: list[NodeState], pod: PodShape, gang: Gang | None) -> list[str]:
    """The nodes best first, as /prioritize's levels and the filter's narrowing rank them."""
    states: dict[str, NodeState | None] = {n.name: n for n in nodes}
    raw = {n.name: policy.raw_score(n, pod) for n in nodes if n.can_host(pod)}
    if gang is None:
        levels, narrowed = to_levels(raw), best_nodes(raw, len(raw))
    else:
        ranked = gang_scores(raw, states, gang)
        levels, narrowed = to_levels(ranked), best_nodes(ranked, len(ranked))
    by_level = sorted(levels, key=lambda n: (-levels[n], n))
    assert narrowed == by_level  # the filter's narrowing agrees with the levels
    return by_level


def tiers_of(ordered: list[str]) -> list[list[str]]:
    """`ordered` cut into groups the sizes of TIERS, each sorted."""
    out, i = [], 0
    for t in TIERS:
        out.append(sorted(ordered[i : i + len(t)]))
        i += len(t)
    return out


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        # within a tier: fewest free left first
        ("binpack", ["g-2", "g-5", "w-h6", "w-a7", "w-a8", "p-3", "p-4", "o-2", "o-5"]),
        # within a tier: most free left first
        ("spread", ["g-5", "g-2", "w-h6", "w-a8", "w-a7", "p-4", "p-3", "o-5", "o-2"]),
        # whole GPUs: -1000 per whole GPU left, bin-packing's order at 1,000 times its spread
        ("migpack", ["g-2", "g-5", "w-h6", "w-a7", "w-a8", "p-3", "p-4", "o-2", "o-5"]),
        ("fragmentation", ["g-2", "g-5", "w-h6", "w-a7", "w-a8", "p-3", "p-4", "o-2", "o-5"]),
    ],
)
def test_gang_tiers_order_first_and_the_policy_orders_within_each(
    policy: str, expected: list[str]
) -> None:
    p = policies()[policy]
    pod = PodShape(2)
    got = order(p, TIER_NODES, pod, TIER_GANG)
    assert got == expected
    assert tiers_of(got) == TIERS
    # Within a tier the policy's own order, as for a pod without a gang.
    for tier in TIERS:
        alone = order(p, [n for n in TIER_NODES if n.name in tier], pod, None)
        assert [n for n in got if n in tier] == alone


class Scaled:
    """A policy's raw scores times 1e12: a spread no added constant could exceed."""

    name = "scaled"

    def __init__(self, inner: Policy) -> None:
        self.inner = inner

    def raw_score(self, node: NodeState, pod: PodShape) -> float:
        return 1e12 * self.inner.raw_score(node, pod)


@pytest.mark.parametrize("policy", ["binpack", "spread", "migpack", "fragmentation"])
def test_no_spread_of_raw_scores_outweighs_a_gang_tier(policy: str) -> None:
    got = order(Scaled(policies()[policy]), TIER_NODES, PodShape(2), TIER_GANG)  # type: ignore[arg-type]
    assert tiers_of(got) == TIERS


def test_a_mig_gang_under_migpack_prefers_its_product_over_two_whole_free_gpus() -> None:
    """migpack's raw score is -1000 per whole free GPU: with constants added ("same
    product" was +1e3), two whole free GPUs outweighed the gang's product. Now the
    product tier decides, and migpack orders the nodes within it."""
    pod = PodShape(0, mig=(("1g.10gb", 1),))
    nodes = [
        gpu_node("same-2-whole", A100, free=2, mig_free=7),  # the gang's product
        gpu_node("same-0-whole", A100, free=0, mig_free=3),  # the gang's product, fuller
        gpu_node("other", H100, free=0, mig_free=7),  # another product, no whole GPU
    ]
    gang = Gang(held={"full": 1}, products=frozenset({A100}), gpus_to_place=0, pod_gpus=0)
    mp = MigPack()
    assert mp.raw_score(nodes[2], pod) - mp.raw_score(nodes[0], pod) > 1e3  # the old bug
    assert order(mp, nodes, pod, gang) == ["same-0-whole", "same-2-whole", "other"]
    assert order(mp, nodes, pod, None) == ["same-0-whole", "other", "same-2-whole"]


def _mig_node(name: str, model: str, whole: int, one_g: int) -> Any:
    n = mig_node(name, one_g=one_g, three_g=0, whole=whole)
    n["metadata"]["labels"][P + "gpu.product"] = model
    return n


def _mig_gang_pod(uid: str, node: str = "") -> Any:
    p = mig_pod(uid, node, **{"1g_10gb": 1})
    p["metadata"]["labels"] = {GANG_LABEL: "mig"}
    return p


def test_a_mig_gang_follows_its_product_through_prioritize() -> None:
    """Through the framework: the gang's first member is bound on an A100 node; the
    next goes to the A100 node with two whole free GPUs, not the H100 node without."""
    c = ClusterState(P)
    c.replace_nodes(
        [
            _mig_node("held", A100, whole=0, one_g=1),
            _mig_node("same", A100, whole=2, one_g=7),
            _mig_node("other", H100, whole=0, one_g=7),
        ]
    )
    c.replace_pods([_mig_gang_pod("m1", "held")])
    policies = {"binpack": BinPack(), "migpack": MigPack()}
    api = ExtenderApi(c, policies, "binpack", CollectorRegistry(), lambda: (True, "ok"))
    names = ["same", "other"]
    _, res = call(
        api, "/prioritize", json.dumps({"Pod": _mig_gang_pod("m2"), "NodeNames": names}).encode()
    )
    assert {r["Host"]: r["Score"] for r in res} == {"same": 10, "other": 9}
    # Without the gang, migpack keeps whole GPUs whole.
    solo = mig_pod("s1", **{"1g_10gb": 1})
    _, res = call(api, "/prioritize", json.dumps({"Pod": solo, "NodeNames": names}).encode())
    assert {r["Host"]: r["Score"] for r in res} == {"other": 10, "same": 9}


@pytest.mark.parametrize("policy", ["binpack", "spread", "migpack", "fragmentation"])
def test_a_gang_with_nothing_placed_and_no_siblings_ranks_as_a_plain_pod(policy: str) -> None:
    """Every node in one tier: the policy's levels and narrowing, unchanged."""
    p = policies()[policy]
    pod = PodShape(2)
    nobody = Gang(held={}, products=frozenset(), gpus_to_place=2, pod_gpus=2)
    states: dict[str, NodeState | None] = {n.name: n for n in TIER_NODES}
    raw = {n.name: p.raw_score(n, pod) for n in TIER_NODES}
    assert to_levels(gang_scores(raw, states, nobody)) == to_levels(raw)
    for k in (1, 3, 9):
        assert best_nodes(gang_scores(raw, states, nobody), k) == best_nodes(raw, k)


# -- pods without a gang: exactly as before --------------------------------------------

# (name, product, GPUs used of 8, 1g MIG devices, utilization %)
PLAIN_NODES = [
    ("a", H100, 0, 0, 90),
    ("b", H100, 2, 7, 10),
    ("c", A100, 4, 3, 0),
    ("d", A100, 6, 0, 50),
    ("e", H100, 8, 7, 0),
    ("f", A100, 5, 0, 0),
]


def _plain_api(policy: str) -> ExtenderApi:
    wall = FakeClock()
    c = ClusterState(P, wall=wall)
    objs = []
    for name, model, _, mig, util in PLAIN_NODES:
        o = node_obj(name, uid=name, util=[util] * 8)
        o["metadata"]["labels"][P + "gpu.product"] = model
        if mig:
            o["status"]["allocatable"]["nvidia.com/mig-1g.10gb"] = str(mig)
        objs.append(o)
    c.replace_nodes(objs)
    c.replace_pods([pod_obj(f"x-{n}", n, used) for n, _, used, _, _ in PLAIN_NODES if used])
    c.replace_leases([lease_obj(n[0], wall(), 300, owner_uid=n[0]) for n in PLAIN_NODES])
    frag = Fragmentation(Workload(fixed=[TypicalPod(PodShape(4), 1), TypicalPod(PodShape(1), 2)]))
    frag.observe_pod("", PodShape(1))
    pols = {"binpack": BinPack(), "spread": Spread(), "migpack": MigPack(), "fragmentation": frag}
    return ExtenderApi(c, pols, policy, CollectorRegistry(), lambda: (True, "ok"), candidates=3)


@pytest.mark.parametrize(
    ("policy", "pod", "narrowed", "scores"),
    [
        # Recorded from the extender before gang tiers became tuples (added constants).
        ("binpack", "1", ["d", "f", "c"], "a6 b7 c8 d10 e0 f9"),
        ("binpack", "4", ["a", "b", "c"], "a8 b9 c10 d0 e0 f0"),
        ("binpack", "mig", ["b", "c", "e"], "a0 b8 c9 d0 e10 f0"),
        ("fragmentation", "2", ["d", "f", "b"], "a6 b8 c7 d10 e0 f9"),
        ("fragmentation", "4", ["a", "b", "c"], "a8 b9 c10 d0 e0 f0"),
        ("fragmentation", "mig", ["b", "c", "e"], "a0 b8 c9 d0 e10 f0"),
        ("migpack", "1", ["d", "f", "c"], "a6 b7 c8 d10 e0 f9"),
        ("migpack", "4", ["a", "b", "c"], "a8 b9 c10 d0 e0 f0"),
        ("migpack", "mig", ["b", "c", "e"], "a0 b8 c9 d0 e10 f0"),
        ("spread", "2", ["a", "b", "c"], "a10 b9 c8 d6 e0 f7"),
        ("spread", "4", ["a", "b", "c"], "a10 b9 c8 d0 e0 f0"),
        ("spread", "mig", ["b", "c", "e"], "a0 b8 c9 d0 e10 f0"),
    ],
)
def test_pods_without_a_gang_filter_and_score_exactly_as_before(
    policy: str, pod: str, narrowed: list[str], scores: str
) -> None:
    api = _plain_api(policy)
    p = pod_obj("", "", 0 if pod == "mig" else int(pod))  # no UID: nothing assumed
    if pod == "mig":
        p["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/mig-1g.10gb": "1"}}
    body = json.dumps({"Pod": p, "NodeNames": [n[0] for n in PLAIN_NODES]}).encode()
    _, filtered = call(api, "/filter", body)
    _, res = call(api, "/prioritize", body)
    assert filtered["NodeNames"] == narrowed
    assert " ".join(f"{h['Host']}{h['Score']}" for h in res) == scores
