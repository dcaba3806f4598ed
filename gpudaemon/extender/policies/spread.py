"""Spread: the more healthy free GPUs a node keeps after placement, the better.

    raw = free_after - w * utilization

For latency-sensitive work that should not share a node's PCIe/NVLink and host
resources; ties go to the less busy node.
"""

from __future__ import annotations

from gpudaemon.extender.policies.base import utilization
from gpudaemon.extender.state import NodeState, PodShape


class Spread:
    name = "spread"
    scores_gpuless_pods = False

    def __init__(self, utilization_weight: float = 0.5) -> None:
        self.utilization_weight = utilization_weight  # < 1: a tie-break, never more

    def scores_version(self) -> object:
        return 0  # a pure function of (node, pod): nothing learned

    def raw_score(self, node: NodeState, pod: PodShape) -> float:
        free_after = node.gpus_free - pod.gpus
        return float(free_after) - self.utilization_weight * utilization(node)
