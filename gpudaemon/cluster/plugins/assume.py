"""Reserve `assume`: count the pod on its node until the watch shows its binding
(ClusterState.assume), so the next pods of a burst are judged from a count that
includes it."""

from __future__ import annotations

from gpudaemon.cluster.clusterstate import ClusterState
from gpudaemon.cluster.plugins.base import POD, CycleState, Handle, PluginSpec


class Assume:
    name = "assume"

    def __init__(self, cluster: ClusterState) -> None:
        self.cluster = cluster

    def reserve(self, state: CycleState, node: str) -> None:
        real = state.read(POD).real
        if real is not None:
            self.cluster.assume(real.uid, node, real.shape, real.gang)


def _new(handle: Handle, args: object) -> Assume:
    return Assume(handle.cluster)


SPEC = PluginSpec("assume", "reserve", _new, "count the pod on its node until bound")
