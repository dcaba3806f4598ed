"""Reserve `assume`: count the pod on its node until the watch shows its binding
(ClusterState.assume), so the next pods of a burst are judged from a count that
includes it."""

from __future__ import annotations

from gpudaemon.cluster.clusterstate import ClusterState
from gpudaemon.cluster.state import PodShape
from gpudaemon.extender.plugins.base import Handle, PluginSpec, register


class Assume:
    name = "assume"

    def __init__(self, cluster: ClusterState) -> None:
        self.cluster = cluster

    def reserve(self, uid: str, node: str, shape: PodShape, gang: str) -> None:
        self.cluster.assume(uid, node, shape, gang)


def _new(handle: Handle) -> Assume:
    return Assume(handle.cluster)


register(PluginSpec("assume", "reserve", _new, "count the pod on its node until bound"))
