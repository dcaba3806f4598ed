"""The model-aware fragmentation policy: each model's share claimed by pinned pods, the
typical set chosen per model set, flexible pods kept off the models pinned pods need,
and plain fragmentation's order when no pod is pinned."""

from __future__ import annotations

from collections import Counter

import pytest

from gpudaemon.cluster.policies import policy_spec
from gpudaemon.cluster.policies.fragmentation import Fragmentation, TypicalPod, Workload
from gpudaemon.cluster.policies.fragmentation_model import (
    ModelFragmentation,
    ModelWorkload,
    pinned_shares,
)
from gpudaemon.cluster.state import NodeState, PodShape
from gpudaemon.config import load_config
from tests.unit.extender.test_fragmentation import node, shape

T4, G2, V100 = "Tesla-T4", "G2", "V100"
# 8 GPUs each of T4 (4 x 2) and V100, 16 of G2: 32 in all
CAPACITY = Counter({(T4, 2, 96_000, 0): 4, (V100, 8, 96_000, 0): 1, (G2, 8, 96_000, 0): 2})


@pytest.mark.parametrize(
    ("groups", "expected"),
    [
        # nothing pinned: no model is claimed
        ({None: 100}, {T4: 0.0, V100: 0.0, G2: 0.0}),
        # T4-only pods are 10% of demand, T4 a quarter of the GPUs: 40% of T4 claimed
        ({None: 90, frozenset({T4}): 10}, {T4: 0.4, V100: 0.0, G2: 0.0}),
        # more pinned demand than the model holds: capped at all of it
        ({None: 50, frozenset({T4}): 50}, {T4: 1.0, V100: 0.0, G2: 0.0}),
        # a pinned set of two models spreads over both by their GPUs (16 of 32)
        ({None: 80, frozenset({T4, V100}): 20}, {T4: 0.4, V100: 0.4, G2: 0.0}),
        # claims of several sets add up on a model they share
        ({None: 80, frozenset({T4}): 10, frozenset({T4, V100}): 10}, {T4: 0.6, V100: 0.2, G2: 0.0}),
        # a model no node has claims nothing anywhere
        ({None: 90, frozenset({"A100"}): 10}, {T4: 0.0, V100: 0.0, G2: 0.0}),
    ],
)
def test_pinned_share_of_each_model(
    groups: dict[frozenset[str] | None, int], expected: dict[str, float]
) -> None:
    got = pinned_shares(groups, CAPACITY)
    assert got == pytest.approx(expected)


def test_a_pinned_set_with_little_demand_keeps_a_typical_shape() -> None:
    w = ModelWorkload(window=1000, max_shapes=2, refresh_every=1)
    for i in range(60):
        w.observe(shape(1, cpu=i % 3))  # three flexible shapes, 60 GPUs
    w.observe(shape(1, 4, models={T4}))  # one pinned pod, 1 GPU
    _, typical = w.typical()
    assert shape(1, 4, models={T4}) in [t.shape for t in typical]
    assert len(typical) == 2
    _, groups = w.groups()
    assert groups == {None: 60, frozenset({T4}): 1}


def cluster() -> list[NodeState]:
    return [
        node("t4", model=T4, gpus=2),
        node("g2", model=G2, gpus=8),
        node("v100", model=V100, gpus=8),
        node("g2b", model=G2, gpus=8),
    ]


def learned(policy: Fragmentation, *pods: tuple[PodShape, int]) -> Fragmentation:
    for n in cluster():
        policy.observe_node(n)
    i = 0
    for s, count in pods:
        for _ in range(count):
            policy.observe_pod(f"p{i}", s)
            i += 1
    return policy


def test_a_flexible_pod_goes_where_no_pinned_pod_needs_the_gpus() -> None:
    # T4-only pods are 12% of the demand for 8% of the GPUs: T4 is all claimed. With
    # room for two typical shapes, plain fragmentation keeps the two flexible ones and
    # forgets the pinned pods: bin-packing sends a flexible pod to the T4 node, the
    # fullest. The model-aware policy keeps a T4-only shape and keeps the pod off T4.
    pods = ((shape(1), 50), (shape(1, cpu=1), 40), (shape(1, models={T4}), 12))
    flexible = shape(1)
    plain = learned(Fragmentation(Workload(max_shapes=2, refresh_every=1)), *pods)
    aware = learned(ModelFragmentation(ModelWorkload(max_shapes=2, refresh_every=1)), *pods)
    t4, g2 = cluster()[0], cluster()[1]
    assert plain.raw_score(t4, flexible) > plain.raw_score(g2, flexible)
    assert aware.raw_score(g2, flexible) > aware.raw_score(t4, flexible)
    assert isinstance(aware, ModelFragmentation)
    assert aware.pinned_share(T4) == pytest.approx(1.0)
    assert aware.pinned_share(G2) == 0.0
    # a T4-only pod still goes to T4: no other node can host it
    pinned = shape(1, models={T4})
    assert aware.raw_score(t4, pinned) > aware.raw_score(g2, pinned)


def test_with_no_pinned_pods_the_order_is_plain_fragmentations() -> None:
    pods = ((shape(1, 8, 32), 40), (shape(2, 16, 64), 20), (shape(8, 64, 256), 5))
    plain = learned(Fragmentation(Workload(refresh_every=1)), *pods)
    aware = learned(ModelFragmentation(ModelWorkload(refresh_every=1)), *pods)
    states = [
        node(f"n{u}-{c}", model=m, gpus=8, used=u, cpu_used=c)
        for m in (G2, V100)
        for u in range(0, 8, 3)
        for c in (0, 40, 90)
    ]
    for pod in (shape(1, 8, 32), shape(2, 16, 64), shape(4)):
        fit = [s for s in states if s.can_host(pod)]

        def order(p: Fragmentation, pod: PodShape = pod, fit: list[NodeState] = fit) -> list[str]:
            return [s.name for s in sorted(fit, key=lambda s: (-p.raw_score(s, pod), s.name))]

        assert order(aware) == order(plain)


def test_registered_and_built_from_config_with_fixed_typical_pods() -> None:
    cfg = load_config(
        None,
        environ={},
        overrides={
            "extender": {
                "policy": "fragmentation-model",
                "typical_pods": [
                    {"gpus": 1, "weight": 0.9},
                    {"gpus": 1, "weight": 0.1, "gpu_models": [T4]},
                ],
            }
        },
    )
    policy = policy_spec("fragmentation-model").factory(cfg.extender)
    assert isinstance(policy, ModelFragmentation)
    assert policy.workload.fixed
    _, groups = policy.workload.groups()
    assert groups == {None: 900, frozenset({T4}): 100}
    assert [t.shape.gpu_models for t in policy.workload.typical()[1]] == [None, frozenset({T4})]
    assert TypicalPod  # the same entries fragmentation uses
