"""The fragmentation policy's defining property, searched by hypothesis over 400 random
clusters, workloads and pods (seconds long; the unit suite stays a quick loop)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gpudaemon.cluster.policies.fragmentation import tie_break
from gpudaemon.cluster.state import NodeState, PodShape
from tests.unit.extender.test_fragmentation import GIB, fixed, node

models = st.sampled_from(["A", "B"])
shapes = st.builds(
    PodShape,
    gpus=st.integers(1, 8),
    cpu_milli=st.integers(0, 64).map(lambda c: c * 1000),
    memory_bytes=st.integers(0, 256).map(lambda g: g * GIB),
    gpu_models=st.one_of(st.none(), st.sets(models, min_size=1).map(frozenset)),
)


@st.composite
def nodes(draw: st.DrawFn, name: str) -> NodeState:
    gpus = draw(st.sampled_from([1, 2, 4, 8]))
    cpu = draw(st.sampled_from([16, 64, 96, 128]))
    mem = draw(st.sampled_from([64, 256, 384, 768]))
    return node(
        name,
        model=draw(models),
        gpus=gpus,
        used=draw(st.integers(0, gpus)),
        cpu=cpu,
        cpu_used=draw(st.integers(0, cpu)),
        mem_gib=mem,
        mem_used_gib=draw(st.integers(0, mem)),
        unhealthy=draw(st.integers(0, 1)),
    )


@settings(max_examples=400, deadline=None)
@given(
    typical=st.lists(st.tuples(shapes, st.integers(1, 50)), min_size=1, max_size=6),
    pod=shapes,
    a=nodes("a"),
    b=nodes("b"),
    cluster=st.lists(nodes("c"), max_size=4),
)
def test_no_placement_scores_above_one_that_fragments_strictly_less(
    typical: list[tuple[PodShape, int]],
    pod: PodShape,
    a: NodeState,
    b: NodeState,
    cluster: list[NodeState],
) -> None:
    policy = fixed(*typical, nodes=[a, b, *cluster])

    def increase(n: NodeState) -> int:
        return policy.fragmentation(n.with_placed(pod)) - policy.fragmentation(n)

    for x, y in ((a, b), (b, a)):
        if x.can_host(pod) and y.can_host(pod) and increase(x) < increase(y):
            assert policy.raw_score(x, pod) > policy.raw_score(y, pod)
    for n in (a, b):
        if n.can_host(pod):
            assert 0 < tie_break(n, pod) < 1
        else:
            assert policy.raw_score(n, pod) < -1e17
