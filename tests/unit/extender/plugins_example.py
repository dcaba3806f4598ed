"""A score plug-in in a file of its own, written as one would add it under
gpudaemon/extender/plugins/ (there, the package imports every file, so the `register`
call below is all the wiring): least busy GPUs first."""

from __future__ import annotations

from gpudaemon.cluster.policies.base import utilization
from gpudaemon.cluster.state import NodeState, PodShape
from gpudaemon.extender.plugins import NodeScore, PluginSpec, register


class LeastBusy(NodeScore):
    name = "least_busy"

    def raw_score(self, node: NodeState, pod: PodShape) -> float:
        return -utilization(node)


SPEC = register(PluginSpec("least_busy", "score", lambda handle: LeastBusy(), "idlest GPUs first"))
