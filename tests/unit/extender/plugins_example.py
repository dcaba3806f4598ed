"""A score plug-in in a file of its own, written as one would add it under
gpudaemon/extender/plugins/ (there, one line in registry.py's table lists its `SPEC`;
here the test registers it): least busy GPUs first."""

from __future__ import annotations

from gpudaemon.cluster.plugins import NodeScore, PluginSpec
from gpudaemon.cluster.policies.base import utilization
from gpudaemon.cluster.state import NodeState, PodShape


class LeastBusy(NodeScore):
    name = "least_busy"

    def raw_score(self, node: NodeState, pod: PodShape) -> float:
        return -utilization(node)


SPEC = PluginSpec("least_busy", "score", lambda handle, args: LeastBusy(), "idlest GPUs first")
