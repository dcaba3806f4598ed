"""The openb arrivals replayed through one policy in process: bench/replay's core, here
so that its tests can use it (tests never import bench/).

The rule is the chart's scheduler's when in-tree scores do not differ: a GPU pod goes
to the extender's pick (`scoring.best`: the highest raw score, ties by node name), and
a pod asking for no GPU as `extender.gpuless_pods` says: at random among the nodes
with no free GPU first (`full_nodes_first`), at random anywhere (`random`), or the
policy's pick (`policy`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

from gpudaemon.cluster.policies.base import Policy
from gpudaemon.cluster.policies.registry import policy_spec
from gpudaemon.cluster.scoring import best
from gpudaemon.cluster.state import NodeState, PodShape
from gpudaemon.config import load_config
from tests.packing_optimum import NodeLike, PodLike

GPULESS = ("full_nodes_first", "random", "policy")


class NodeRow(NodeLike, Protocol):
    @property
    def name(self) -> str: ...


def replay(
    rows: Sequence[NodeRow], seq: Sequence[PodLike], seed: int, policy_name: str, gpuless: str
) -> tuple[float, float, list[list[int]]]:
    """(unallocated GPU % when arrived GPU requests reach the cluster's GPUs, at the
    end, the pods turned away by then as [GPUs, CPU milli, memory MiB])."""
    total = sum(n.gpus for n in rows)
    ext = load_config(None, environ={}, overrides={}).extender
    policy: Policy = policy_spec(policy_name).factory(ext)
    state: dict[str, NodeState] = {}
    for r in rows:
        state[r.name] = NodeState(
            r.name,
            gpu_model=r.model,
            gpus_allocatable=r.gpus,
            gpus_total=r.gpus,
            cpu_allocatable_milli=r.cpu_milli,
            memory_allocatable_bytes=r.memory_mib << 20,
        )
        policy.observe_node(state[r.name])
    rng = random.Random(seed)
    arrived = allocated = 0
    at100: float | None = None
    skipped: list[list[int]] = []
    for i, p in enumerate(seq):
        pod = PodShape(
            p.gpus, p.cpu_milli, p.memory_mib << 20, frozenset(p.gpu_spec) if p.gpu_spec else None
        )
        fit = [
            s
            for s in state.values()
            if s.gpus_free >= pod.gpus
            and s.cpu_free_milli >= pod.cpu_milli
            and s.memory_free_bytes >= pod.memory_bytes
            and pod.fits_model(s.gpu_model)
        ]
        arrived += p.gpus
        pick: str | None = None
        if fit and (pod.gpus > 0 or gpuless == "policy"):
            if pod.gpus > 0:
                policy.observe_pod(f"uid-{i}", pod)
            pick = best({s.name: policy.raw_score(s, pod) for s in fit})
        elif fit:
            full = [s for s in fit if s.gpus_free <= 0] if gpuless == "full_nodes_first" else []
            pick = rng.choice(full or fit).name
        if pick is not None:
            s = state[pick]
            state[pick] = new = replace(
                s,
                gpus_requested=s.gpus_requested + pod.gpus,
                cpu_requested_milli=s.cpu_requested_milli + pod.cpu_milli,
                memory_requested_bytes=s.memory_requested_bytes + pod.memory_bytes,
            )
            policy.observe_node(new)
            allocated += pod.gpus
        elif at100 is None:
            skipped.append([p.gpus, p.cpu_milli, p.memory_mib])
        if at100 is None and arrived >= total:
            at100 = 100.0 * (total - allocated) / total
    if at100 is None:  # fewer GPUs arrived than the cluster has: the end is the cut
        at100 = 100.0 * (total - allocated) / total
    return at100, 100.0 * (total - allocated) / total, skipped
