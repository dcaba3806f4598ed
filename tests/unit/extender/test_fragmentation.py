"""The fragmentation policy: what counts as stranded GPUs, how the workload is learned,
and the property that a strictly smaller fragmentation increase always scores higher."""

from __future__ import annotations

from collections import Counter

import pytest

from gpudaemon.cluster.policies import fragmentation
from gpudaemon.cluster.policies.fragmentation import (
    Fragmentation,
    TypicalPod,
    Workload,
    make_fragmentation,
    whole_node_shapes,
)
from gpudaemon.cluster.state import NodeState, PodShape
from gpudaemon.config import load_config

GIB = 2**30


def node(
    name: str = "n",
    model: str = "G2",
    gpus: int = 8,
    used: int = 0,
    cpu: int = 96,
    cpu_used: int = 0,
    mem_gib: int = 384,
    mem_used_gib: int = 0,
    unhealthy: int = 0,
) -> NodeState:
    return NodeState(
        name=name,
        gpu_model=model,
        gpus_allocatable=gpus,
        gpus_requested=used,
        gpus_unhealthy=unhealthy,
        cpu_allocatable_milli=cpu * 1000,
        cpu_requested_milli=cpu_used * 1000,
        memory_allocatable_bytes=mem_gib * GIB,
        memory_requested_bytes=mem_used_gib * GIB,
    )


def shape(gpus: int, cpu: int = 0, mem_gib: int = 0, models: set[str] | None = None) -> PodShape:
    return PodShape(gpus, cpu * 1000, mem_gib * GIB, None if models is None else frozenset(models))


def fixed(*items: tuple[PodShape, int], nodes: list[NodeState] | None = None) -> Fragmentation:
    """A policy with a fixed workload; `nodes` are the cluster it has seen (for shares)."""
    policy = Fragmentation(Workload(fixed=[TypicalPod(s, w) for s, w in items]))
    for n in nodes or []:
        policy.observe_node(n)  # the informer's node events (scoring learns nothing)
    policy.observe_pod("", PodShape(1))  # ... applied at the next arrival
    return policy


# -- fragmentation of one node: a table ------------------------------------------------


@pytest.mark.parametrize(
    ("n", "typical", "expected"),
    [
        # an empty node serves a 1-GPU shape fully
        (node(), [(shape(1, 4, 16), 1)], 0),
        # 3 free GPUs, 2-GPU pods: one GPU left over
        (node(used=5), [(shape(2), 1)], 1),
        # 8 free GPUs but CPU for only 2 copies of a 1-GPU 40-core shape: 6 stranded
        (node(), [(shape(1, 40), 1)], 6),
        # memory strands the same way: 384 GiB / 100 GiB = 3 copies -> 5 stranded
        (node(), [(shape(1, 0, 100), 1)], 5),
        # the wrong model strands every free GPU
        (node(used=6), [(shape(1, models={"V100M32"}), 1)], 2),
        # the right model strands none
        (node(model="V100M32", used=6), [(shape(1, models={"V100M32"}), 1)], 0),
        # too few GPUs for an 8-GPU shape: all 4 free are stranded for it
        (node(used=4), [(shape(8), 1)], 4),
        # weights add up: 4 stranded for the 8-GPU shape x 3, none for the 1-GPU one
        (node(used=4), [(shape(8), 3), (shape(1), 5)], 12),
        # nothing free, nothing stranded
        (node(used=8), [(shape(8), 1)], 0),
        # unhealthy GPUs are not free GPUs
        (node(unhealthy=4), [(shape(8), 1)], 4),
    ],
)
def test_fragmentation_counts_free_gpus_typical_pods_cannot_use(
    n: NodeState, typical: list[tuple[PodShape, int]], expected: int
) -> None:
    assert fixed(*typical).fragmentation(n) == expected


# -- placement scores: tables of "which node wins" --------------------------------------


@pytest.mark.parametrize(
    ("why", "typical", "pod", "better", "worse"),
    [
        (
            "a 1-GPU pod goes to a broken node, keeping a whole one for 8-GPU pods",
            [(shape(8), 1), (shape(1), 1)],
            shape(1),
            node(used=5),
            node(),
        ),
        (
            "a pod goes where its CPU does not strand the GPUs left behind",
            [(shape(1, 12), 1)],
            shape(1, 24),
            node(cpu=200),  # 7 GPUs, 176 cores left: still 7 copies
            node(cpu=96),  # 7 GPUs, 72 cores left: 6 copies, 1 GPU stranded
        ),
        (
            "an unconstrained pod stays off the only model a pinned shape can use",
            [(shape(1, models={"V100M32"}), 1)],
            shape(1),
            node(model="T4", gpus=2),
            node(model="V100M32", gpus=2),
        ),
        (
            "a pod with no GPU goes where it strands no GPU: a node with none free",
            [(shape(1, 12), 1)],
            shape(0, 60),
            node(used=8),
            node(used=4),  # 60 of 96 cores gone: 4 free GPUs keep CPU for 3 copies
        ),
        (
            "equal fragmentation: bin-packing decides (fewer free GPUs left)",
            [(shape(1), 1)],
            shape(1),
            node(used=6),
            node(used=2),
        ),
        (
            "equal fragmentation and free GPUs: more of the CPU used wins",
            [(shape(1), 1)],
            shape(1),
            node(used=6, cpu_used=60),
            node(used=6, cpu_used=10),
        ),
    ],
)
def test_placement_order(
    why: str,
    typical: list[tuple[PodShape, int]],
    pod: PodShape,
    better: NodeState,
    worse: NodeState,
) -> None:
    policy = fixed(*typical)
    assert policy.raw_score(better, pod) > policy.raw_score(worse, pod), why


def test_a_node_that_cannot_host_the_pod_scores_below_every_one_that_can() -> None:
    policy = fixed((shape(1), 1))
    full = policy.raw_score(node(used=8), shape(1))
    assert full < policy.raw_score(node(used=0, cpu=1, cpu_used=0), shape(1)) - 1e6
    wrong_model = policy.raw_score(node(model="T4"), shape(1, models={"G2"}))
    assert wrong_model == full


def test_shapes_few_nodes_can_host_weigh_more() -> None:
    """An 8-GPU 120-core shape fits only the 128-core node class: those nodes are
    protected from a 4-GPU pod that also fits the 96-core class."""
    big = node("big", cpu=128, mem_gib=768)
    small = node("small", cpu=96, mem_gib=384)
    cluster = [node(f"s{i}", cpu=96, mem_gib=384) for i in range(9)] + [big]
    typical = [(shape(8, 120, 600), 1), (shape(4, 60, 300), 4)]
    pod = shape(4, 60, 300)
    share_aware = fixed(*typical, nodes=cluster)
    assert share_aware.raw_score(small, pod) > share_aware.raw_score(big, pod)
    # The 8-GPU shape fits 8 of the cluster's 80 GPUs: its weight is multiplied by 10.
    stranded_on_big = node("big", cpu=128, mem_gib=768, used=4)
    assert fixed((shape(8, 120, 600), 1), nodes=cluster).fragmentation(stranded_on_big) == 40


def test_a_shape_no_node_can_ever_host_is_ignored() -> None:
    policy = fixed((shape(16), 100), (shape(1), 1), nodes=[node("a"), node("b")])
    # only the 1-GPU shape counts: an 8-free node strands nothing for it
    assert policy.fragmentation(node("a")) == 0


# -- the workload: learned online, or fixed ------------------------------------------------


def test_workload_learns_shapes_weighted_by_gpu_demand() -> None:
    w = Workload(window=100, refresh_every=1)
    for _ in range(8):
        w.observe(shape(1))
    w.observe(shape(8))
    w.observe(shape(0, 4))  # asks for no GPU: cannot use GPUs, not counted
    _, typical = w.typical()
    assert [(t.shape.gpus, t.weight) for t in typical] == [(1, 8), (8, 8)]


def test_workload_window_forgets_old_pods() -> None:
    w = Workload(window=3, refresh_every=1)
    for g in (8, 1, 1, 1):
        w.observe(shape(g))
    _, typical = w.typical()
    assert [(t.shape.gpus, t.weight) for t in typical] == [(1, 3)]


def test_workload_keeps_the_shapes_with_most_gpu_demand() -> None:
    w = Workload(window=100, max_shapes=2, refresh_every=1)
    for s, n in ((shape(1, 1), 5), (shape(1, 2), 3), (shape(4), 2)):
        for _ in range(n):
            w.observe(s)
    _, typical = w.typical()
    assert [t.shape for t in typical] == [shape(4), shape(1, 1)]


def test_version_moves_only_when_the_typical_set_changes() -> None:
    w = Workload(window=1000, refresh_every=10)
    for _ in range(40):
        w.observe(shape(1))
    v = w.version
    for _ in range(100):
        w.observe(shape(1))
    # counts change, so the set is re-weighted at each refresh, but not on every pod
    assert w.version - v <= 10


def test_fixed_workload_ignores_observed_pods() -> None:
    w = Workload(fixed=[TypicalPod(shape(2), 1)])
    for _ in range(10):
        w.observe(shape(1))
    assert w.typical() == (1, (TypicalPod(shape(2), 1),))
    assert w.observed == 10


@pytest.mark.parametrize("bad", [[], [TypicalPod(shape(0), 1)], [TypicalPod(shape(1), 0)]])
def test_fixed_workload_rejects_empty_or_bad_entries(bad: list[TypicalPod]) -> None:
    with pytest.raises(ValueError):
        Workload(fixed=bad)


def test_a_retried_pod_is_one_arrival() -> None:
    policy = Fragmentation(Workload(refresh_every=1))
    for _ in range(5):
        policy.observe_pod("uid-1", shape(8))
    policy.observe_pod("uid-2", shape(1))
    _, typical = policy.workload.typical()
    assert sorted((t.shape.gpus, t.weight) for t in typical) == [(1, 1), (8, 8)]


def test_new_capacities_apply_at_the_next_arrival_not_mid_request() -> None:
    policy = fixed((shape(8, 120), 1), (shape(1), 1))
    big = node("big", cpu=128)
    policy.observe_node(node("small"))
    policy.observe_node(big)  # a node event in the middle of a request ...
    before = policy.raw_score(big, shape(1))
    assert policy.raw_score(big, shape(1)) == before  # same request, same tables
    policy.observe_pod("next", shape(1))
    assert policy.raw_score(big, shape(1)) != before  # the big node's class is rare now


def test_scoring_learns_nothing_and_a_deleted_node_is_forgotten() -> None:
    """raw_score is pure (issue 23): scoring nodes never seen as node events changes no
    table; forgetting a node changes the shares at the next arrival."""
    policy = fixed((shape(8, 120), 1), (shape(1), 1), nodes=[node("small")])
    big = node("big", cpu=128)
    version = policy.scores_version()
    for _ in range(3):
        policy.raw_score(big, shape(1))
    policy.observe_pod("next", shape(1))
    assert policy.scores_version() == version  # nothing new was learned from scoring
    policy.observe_node(big)
    policy.observe_pod("again", shape(1))
    with_big = policy.raw_score(big, shape(1))
    policy.forget_node("big")
    policy.observe_pod("third", shape(1))
    assert policy.raw_score(big, shape(1)) != with_big


def test_make_fragmentation_from_config() -> None:
    cfg = load_config(
        None,
        environ={},
        overrides={
            "extender": {
                "policy": "fragmentation",
                "typical_pods": [
                    {"gpus": 8, "cpu_milli": 64000, "memory_mib": 262144, "weight": 0.1},
                    {"gpus": 1, "cpu_milli": 8000, "gpu_models": ["V100M32"], "weight": 0.9},
                ],
            }
        },
    )
    policy = make_fragmentation(cfg.extender)
    assert policy.workload.fixed
    _, typical = policy.workload.typical()
    assert {(t.shape.gpus, t.shape.gpu_models, t.weight) for t in typical} == {
        (8, None, 800),
        (1, frozenset({"V100M32"}), 900),
    }
    learned = make_fragmentation(load_config(None, environ={}, overrides={}).extender)
    assert not learned.workload.fixed and learned.workload.window == 2000


def test_memoized_scores_equal_fresh_ones() -> None:
    typical = [(shape(8, 64, 256), 3), (shape(1, 12, 48), 20), (shape(2, 16, 64), 2)]
    warm = fixed(*typical)
    states = [node(used=u, cpu_used=c) for u in range(9) for c in (0, 30, 90)]
    first = [warm.raw_score(n, shape(1, 12, 48)) for n in states]
    again = [warm.raw_score(n, shape(1, 12, 48)) for n in states]
    cold = [fixed(*typical).raw_score(n, shape(1, 12, 48)) for n in states]
    assert first == again == cold


def test_a_reader_never_sees_the_new_version_before_the_new_tables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`scores_version` and the tables are one reference: a request reading the version
    while another thread builds new tables must get the old version (it scores with the
    old tables), or the score memo would keep old-table scores under the new version."""
    from gpudaemon.cluster.policies import fragmentation

    frag = Fragmentation(Workload(window=4, refresh_every=1))
    frag.observe_pod("a", PodShape(1))
    before = frag.scores_version()
    seen: list[object] = []
    build = fragmentation._Tables.__init__

    def slow_build(self: object, *args: object) -> None:
        seen.append(frag.scores_version())  # another thread, mid-build
        build(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(fragmentation._Tables, "__init__", slow_build)
    frag.observe_pod("b", PodShape(2))  # a new typical set: new tables
    assert seen == [before]
    assert frag.scores_version() != before


# -- the whole-node prior --------------------------------------------------------------


def learned(*seen: PodShape, nodes: list[NodeState]) -> Fragmentation:
    """A learning policy that has seen these GPU pods on this cluster."""
    policy = Fragmentation(Workload(refresh_every=1))
    for n in nodes:
        policy.observe_node(n)
    for i, s in enumerate(seen):
        policy.observe_pod(f"uid-{i}", s)
    return policy


def test_small_pods_leave_the_rare_big_node_class_whole_before_a_big_pod_is_seen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The openb default list's case: 549 8-GPU 96-core nodes and 39 8-GPU 128-core
    ones, every node empty, and only 1-GPU pods seen so far. A 1-GPU 11-core pod on a
    96-core node leaves as many copies of the seen 19-core shape as before (5, then 4
    of 7 free), and on a 128-core node one more (6 of 8, then 6 of 7), so the packing
    term alone starts a 128-core node, the only class an unseen 8-GPU 120-core pod can
    use. The prior (one whole-node pod per class) keeps that class whole."""
    cluster = [node(f"g2-{i}", cpu=96, mem_gib=384) for i in range(14)]
    cluster.append(node("g3", model="G3", cpu=128, mem_gib=768))
    seen = [shape(1, 19, 60)] * 3 + [shape(1, 11, 40)] * 5
    pod = shape(1, 11, 40)
    policy = learned(*seen, nodes=cluster)
    assert policy.raw_score(cluster[0], pod) > policy.raw_score(cluster[-1], pod)
    # Without the prior the same policy starts the big node: the test can tell.
    monkeypatch.setattr(fragmentation, "PRIOR_SHAPES", 0)
    policy = learned(*seen, nodes=cluster)
    assert policy.raw_score(cluster[0], pod) < policy.raw_score(cluster[-1], pod)


def test_whole_node_shapes_one_per_set_of_hosts_rarest_first() -> None:
    """Classes that differ by a kubelet reservation share a shape; a shape that fits
    the same classes as a bigger one is dropped; the rarest hosts come first, and each
    weighs one arrival (its GPUs)."""
    gib = GIB
    capacity = Counter(
        {
            ("G2", 8, 96_000, 384 * gib): 50,
            ("G2", 8, 96_000, 384 * gib - 300 * 2**20): 40,  # a larger reservation
            ("G3", 8, 128_000, 768 * gib): 3,
            ("T4", 2, 16_000, 64 * gib): 20,
            ("T4", 0, 16_000, 64 * gib): 5,  # no GPUs: no shape
        }
    )
    prior = whole_node_shapes(capacity)
    assert [(t.shape.gpus, t.shape.cpu_milli // 1000, t.weight) for t in prior] == [
        (8, 114, 8),  # fits only the 3 G3 nodes
        (8, 86, 8),  # the 90 G2 nodes (both reservations) and G3
        (2, 14, 2),  # everything with 2 GPUs or more
    ]
    assert all(t.shape.gpu_models is None for t in prior)


def test_at_most_prior_shapes_whole_node_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    capacity = Counter({("G2", g, 8_000 * g, 32 * g * GIB): 1 for g in range(1, 9)})
    assert len(whole_node_shapes(capacity)) == 8
    monkeypatch.setattr(fragmentation, "PRIOR_SHAPES", 3)
    assert [t.shape.gpus for t in whole_node_shapes(capacity)] == [8, 7, 6]


def test_a_fixed_workload_gets_no_prior() -> None:
    cluster = [node("small"), node("big", model="G3", cpu=128, mem_gib=768)]
    policy = fixed((shape(1, 16, 60), 1), nodes=cluster)
    assert policy.fragmentation(node("big", model="G3", cpu=128, mem_gib=768, used=1)) == 0


def test_the_prior_follows_the_node_classes() -> None:
    """Computed once per set of capacities, and again when a new class appears."""
    policy = learned(shape(1), nodes=[node("small")])
    big_used = node("big", model="G3", cpu=128, mem_gib=768, used=1)
    before = policy.fragmentation(big_used)
    policy.observe_node(node("big", model="G3", cpu=128, mem_gib=768))
    policy.observe_pod("next", shape(1))
    # The 128-core class's own whole-node shape no longer fits it once one GPU is used.
    assert policy.fragmentation(big_used) > before


def test_two_rare_classes_with_equal_counts_keep_a_shape_each() -> None:
    """4 nodes of 128 cores / 512 GiB and 4 of 96 cores / 1.5 TiB: as many GPUs and
    classes can host either one's whole-node shape, but not the same ones."""
    capacity = Counter(
        {
            ("G2", 8, 64_000, 256 * GIB): 50,
            ("A", 8, 128_000, 512 * GIB): 4,
            ("B", 8, 96_000, 1536 * GIB): 4,
        }
    )
    shapes = {
        (t.shape.cpu_milli // 1000, t.shape.memory_bytes // GIB)
        for t in whole_node_shapes(capacity)
    }
    assert {(114, 448), (86, 1344)} <= shapes


def test_a_node_claiming_implausibly_many_gpus_gets_no_prior_shape() -> None:
    """A compromised node sets its own allocatable: 4e18 GPUs would weigh 4e18 and
    drown every score's tie-break in float rounding."""
    capacity = Counter({("G2", 8, 96_000, 384 * GIB): 10, ("G2", 4 * 10**18, 1000, GIB): 1})
    assert [t.shape.gpus for t in whole_node_shapes(capacity)] == [8]


def test_with_many_classes_the_rarest_still_get_a_shape() -> None:
    """More distinct shapes than are tried: the one 4 TiB 2-GPU node is among them."""
    capacity = Counter({("G2", 8, int(64_000 * 1.1**i), 256 * GIB): 10 for i in range(80)})
    capacity[("T4", 2, 16_000, 4096 * GIB)] = 1
    shapes = [(t.shape.gpus, t.shape.memory_bytes // GIB) for t in whole_node_shapes(capacity)]
    assert (2, 3584) in shapes
