"""Spread: the more healthy free GPUs a node keeps after placement, the better.

    raw = free_after - w * utilization

For latency-sensitive work that should not share a node's PCIe/NVLink and host
resources; ties go to the less busy node.
"""

from __future__ import annotations

from gpudaemon.cluster.policies.base import FreeGpuPolicy, PolicySpec, utilization
from gpudaemon.cluster.state import NodeState, PodShape


class Spread(FreeGpuPolicy):
    name = "spread"

    def raw_score(self, node: NodeState, pod: PodShape) -> float:
        free_after = node.gpus_free - pod.gpus
        return float(free_after) - self.utilization_weight * utilization(node)


SPEC = PolicySpec(
    "spread",
    lambda ext: Spread(ext.utilization_weight),
    "most healthy free GPUs left after placement (LeastAllocated for GPUs)",
    ("utilization_weight",),
)
