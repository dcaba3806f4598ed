"""Bin-packing: the fewer healthy free GPUs a node has left after placement, the better.

    raw = -(free_after) + w * utilization

`free_after` moves in whole GPUs, so the utilization term (< 1) only breaks ties
between nodes left equally full; among those the busier node wins, which keeps idle
nodes whole for the next large pod.
"""

from __future__ import annotations

from gpudaemon.cluster.policies.base import FreeGpuPolicy, PolicySpec, utilization
from gpudaemon.cluster.state import NodeState, PodShape


class BinPack(FreeGpuPolicy):
    name = "binpack"

    def raw_score(self, node: NodeState, pod: PodShape) -> float:
        free_after = node.gpus_free - pod.gpus
        return -float(free_after) + self.utilization_weight * utilization(node)


SPEC = PolicySpec(
    "binpack",
    lambda ext: BinPack(ext.utilization_weight),
    "fewest healthy free GPUs left after placement (MostAllocated for GPUs)",
    ("utilization_weight",),
)
