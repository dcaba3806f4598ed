"""The rebalancer's defragmentation search (candidates ranked by cost, hosts ranked once
per pass: fast at 5,000 nodes) finds exactly the plan of the first version's exhaustive
search (`bench/rebalancer.py:exhaustive`, the bench's baseline), over random small
fleets: node sizes and GPU products, pods of 1-4 GPUs, opted in or not, of higher
priority or not, pinned by nodeSelector or not, and each policy."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from bench.rebalancer import exhaustive, node, planner_inputs, pod, rebalancer
from gpudaemon.rebalancer.planner import Placer, defragment

PRODUCTS = ["NVIDIA-H100-80GB-HBM3", "NVIDIA-A100-SXM4-80GB"]


@st.composite
def fleets(draw: st.DrawFn) -> tuple[list[Any], list[Any], dict[str, Any], str]:
    """Fragmented fleets: each node filled with small pods until a few GPUs are left,
    and a pending pod larger than any node's free GPUs, so that most cases have a plan
    to find and several candidate nodes to rank."""
    n = draw(st.integers(2, 7))
    nodes = [node(i, gpus=draw(st.sampled_from([4, 8, 8])),
                  product=draw(st.sampled_from(PRODUCTS))) for i in range(n)]  # fmt: skip
    running, most_free = [], 0
    for i, obj in enumerate(nodes):
        free = int(obj["status"]["allocatable"]["nvidia.com/gpu"])
        leave = draw(st.integers(0, 3))
        j = 0
        while free > leave:
            gpus = min(free - leave, draw(st.integers(1, 3)))
            free -= gpus
            opt_in = draw(st.integers(0, 9)) < 8
            p = pod(f"p{i}-{j}", obj["metadata"]["name"], gpus, opt_in=opt_in)
            if draw(st.integers(0, 9)) == 0:
                p["spec"]["priority"] = 1000  # never evicted for a pod of priority 0
            if draw(st.integers(0, 9)) == 0:
                p["spec"]["nodeSelector"] = {"team": "x"}  # no node has it: cannot move
            running.append(p)
            j += 1
        most_free = max(most_free, free)
    model = draw(st.sampled_from(["", "", *PRODUCTS]))
    pending = pod("big", "", draw(st.integers(min(most_free + 1, 8), 8)), opt_in=False,
                  model=model)  # fmt: skip
    policy = draw(st.sampled_from(["binpack", "spread", "fragmentation"]))
    return nodes, running, pending, policy


@settings(max_examples=300, deadline=None)
@given(fleets())
def test_the_ranked_search_finds_the_exhaustive_searchs_plan(
    case: tuple[list[Any], list[Any], dict[str, Any], str],
) -> None:
    nodes, running, pending, policy = case
    rb = rebalancer(nodes, running, [pending], policy)
    [big] = list(rb.pending.values())
    args = planner_inputs(rb, big)
    assert defragment(*args) == exhaustive(*args)
    # A Placer shared across pending pods of a pass gives the same answer again.
    placer = Placer(*args[1:4], args[5], args[4])
    assert defragment(*args, placer=placer) == defragment(*args, placer=placer)
