"""MIG packing, for pods that ask for MIG devices (`nvidia.com/mig-<profile>`, the
device plugin's mixed strategy): used for them unless their annotation names another.

    raw = -WHOLE * whole_free - mig_free_after + w * utilization

A node with whole free GPUs loses to any node where the MIG devices fit without one
(WHOLE outweighs every MIG count), so whole GPUs stay whole for the pods that need
them; among the rest, the node with the fewest free MIG devices after placement wins,
which fills partly used nodes first. Which GPU of the node serves the device is the
device plugin's choice, not the scheduler's.
"""

from __future__ import annotations

from gpudaemon.cluster.policies.base import FreeGpuPolicy, PolicySpec, utilization
from gpudaemon.cluster.state import NodeState, PodShape

WHOLE = 1000.0  # more than a node's MIG devices (at most 7 per GPU, and 64 GPUs)


class MigPack(FreeGpuPolicy):
    name = "migpack"

    def raw_score(self, node: NodeState, pod: PodShape) -> float:
        free_after = node.mig_free_total - sum(n for _, n in pod.mig)
        whole_after = node.gpus_free - pod.gpus
        return (
            -WHOLE * whole_after - float(free_after) + self.utilization_weight * utilization(node)
        )


SPEC = PolicySpec(
    "migpack",
    lambda ext: MigPack(ext.utilization_weight),
    "for MIG pods (the default for them): nodes without whole free GPUs first, then "
    "the fewest free MIG devices left after placement",
    ("utilization_weight",),
)
