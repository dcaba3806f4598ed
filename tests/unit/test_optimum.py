"""The offline packing optimum behind bench/optimum (tests/packing_optimum.py): on
instances small enough to try every placement, the MILP's placement allocates exactly
the brute-force maximum and the LP bound is never below it; a pod pinned to GPU models
is never counted on a node of another; a placement that breaks a rule is refused."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import pytest

from tests.packing_optimum import (
    InvalidPlacement,
    NodeType,
    PodType,
    all_columns,
    check,
    node_types,
    pod_types,
    solve,
)


@dataclass(frozen=True)
class Node:
    model: str
    gpus: int
    cpu_milli: int
    memory_mib: int


@dataclass(frozen=True)
class Pod:
    gpus: int
    cpu_milli: int
    memory_mib: int
    gpu_spec: tuple[str, ...] = ()


def brute_force(nodes: list[Node], pods: list[Pod]) -> int:
    """Every assignment of every pod to a node or to none: the most GPUs allocated."""
    best = 0
    for where in itertools.product(range(len(nodes) + 1), repeat=len(pods)):
        use = [[0, 0, 0] for _ in nodes]
        ok = True
        for pod, n in zip(pods, where, strict=True):
            if n == len(nodes):
                continue
            if pod.gpu_spec and nodes[n].model not in pod.gpu_spec:
                ok = False
                break
            use[n][0] += pod.gpus
            use[n][1] += pod.cpu_milli
            use[n][2] += pod.memory_mib
        ok = ok and all(
            u[0] <= nd.gpus and u[1] <= nd.cpu_milli and u[2] <= nd.memory_mib
            for u, nd in zip(use, nodes, strict=True)
        )
        if ok:
            best = max(best, sum(u[0] for u in use))
    return best


def random_instance(rng: random.Random) -> tuple[list[Node], list[Pod]]:
    shapes = [("A", 4, 16, 64), ("A", 2, 8, 32), ("B", 4, 8, 64), ("B", 8, 32, 128)]
    nodes = [Node(*rng.choice(shapes)) for _ in range(rng.randint(2, 3))]
    pods = []
    for _ in range(rng.randint(3, 6)):
        spec = rng.choice([(), (), ("A",), ("B",), ("A", "B")])
        pods.append(
            Pod(
                rng.choice([0, 1, 1, 2, 4]),
                rng.choice([2, 4, 6, 10]),
                rng.choice([8, 16, 40]),
                spec,
            )
        )
    return nodes, pods


INSTANCES = [random_instance(random.Random(seed)) for seed in range(25)]


@pytest.mark.parametrize(("nodes", "pods"), INSTANCES)
def test_column_generation_bound_and_placement_match_brute_force(
    nodes: list[Node], pods: list[Pod]
) -> None:
    best = brute_force(nodes, pods)
    nts, pts = node_types(nodes), pod_types(pods)
    sol = solve(nts, pts, milp_time_limit_s=5)
    assert sol.bound_gpus >= best
    assert check(nts, pts, sol.placement) == sol.placed_gpus
    assert sol.placed_gpus == best
    assert sol.proven


@pytest.mark.parametrize(("nodes", "pods"), INSTANCES)
def test_master_over_every_configuration_is_the_brute_force_optimum(
    nodes: list[Node], pods: list[Pod]
) -> None:
    best = brute_force(nodes, pods)
    nts, pts = node_types(nodes), pod_types(pods)
    sol = solve(nts, pts, columns=all_columns(nts, pts), milp_time_limit_s=5)
    assert sol.bound_gpus >= sol.placed_gpus == best


def test_the_instances_are_not_all_trivial() -> None:
    """Some leave GPUs free whatever the placement, some fill every GPU."""
    fractions = [brute_force(nodes, pods) / sum(n.gpus for n in nodes) for nodes, pods in INSTANCES]
    assert min(fractions) < 0.5 and max(fractions) == 1.0
    assert any(p.gpu_spec for _, pods in INSTANCES for p in pods)


def test_pinned_pods_are_never_counted_on_another_model() -> None:
    """Three 4-GPU pods for A, room for two on the one A node; the B node stays empty."""
    nodes = [Node("A", 8, 64, 256), Node("B", 8, 64, 256)]
    pods = [Pod(4, 8, 16, ("A",))] * 3
    nts, pts = node_types(nodes), pod_types(pods)
    sol = solve(nts, pts)
    assert (sol.bound_gpus, sol.placed_gpus) == (8, 8)
    assert sol.unallocated_bound_pct == sol.unallocated_placed_pct == 50.0
    for t, counts, k in sol.placement:
        assert k == 0 or not any(counts) or nts[t].model == "A"


def test_the_bound_is_not_the_capacity_when_resources_other_than_gpus_bind() -> None:
    """Two 8-GPU nodes with 64 cores; 1-GPU pods of 16 cores: four per node at most."""
    nodes = [Node("A", 8, 64_000, 256)] * 2
    pods = [Pod(1, 16_000, 8)] * 16
    sol = solve(node_types(nodes), pod_types(pods))
    assert (sol.bound_gpus, sol.placed_gpus, sol.total_gpus) == (8, 8, 16)


def test_check_refuses_a_pinned_pod_on_another_model() -> None:
    nts = [NodeType("A", 8, 64, 256, 1), NodeType("B", 8, 64, 256, 1)]
    pts = [PodType(4, 8, 16, frozenset({"A"}), 3)]
    assert check(nts, pts, [(0, (2,), 1)]) == 8
    with pytest.raises(InvalidPlacement, match="on a B node"):
        check(nts, pts, [(0, (2,), 1), (1, (1,), 1)])


@pytest.mark.parametrize(
    ("placement", "broken"),
    [
        ([(0, (3,), 1)], "over allocatable"),  # 9 GPUs on an 8-GPU node
        ([(1, (2,), 1)], "over allocatable"),  # 48 cores on a 40-core node
        ([(0, (1,), 2)], "2 nodes of type 0, which has 1"),
        ([(0, (2,), 1), (1, (1,), 1)], "3 pods of type 0, of 2 arrived"),
        ([(0, (-1,), 1)], "negative count"),
    ],
)
def test_check_refuses_a_placement_that_breaks_a_rule(
    placement: list[tuple[int, tuple[int, ...], int]], broken: str
) -> None:
    nts = [NodeType("A", 8, 64, 256, 1), NodeType("A", 8, 40, 256, 1)]
    pts = [PodType(3, 24, 16, frozenset(), 2)]
    with pytest.raises(InvalidPlacement, match=broken):
        check(nts, pts, placement)


def test_types_aggregate_identical_nodes_and_pods() -> None:
    nodes = [Node("A", 8, 64, 256)] * 3 + [Node("B", 8, 64, 256)]
    pods = [Pod(1, 4, 8), Pod(1, 4, 8), Pod(1, 4, 8, ("A",)), Pod(0, 4, 8)]
    assert [(n.model, n.count) for n in node_types(nodes)] == [("A", 3), ("B", 1)]
    assert sorted((p.gpus, sorted(p.models), p.count) for p in pod_types(pods)) == [
        (0, [], 1),
        (1, [], 2),
        (1, ["A"], 1),
    ]
