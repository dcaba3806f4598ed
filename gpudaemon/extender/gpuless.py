"""How a pod asking for no GPU is ranked (`extender.gpuless_pods: full_nodes_first`).

Its CPU and memory strand nothing on a node with no free GPU or MIG device, and can
strand the GPUs beside them anywhere else. So such nodes score 10 and the rest 0, and
kube-scheduler draws at random within each level. The answer per node is kept between
requests and brought up to date from `ClusterState.changes`, as the verdict tables
are: a 5,000-node request then costs a dictionary lookup per node, not a node state.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from gpudaemon.cluster.clusterstate import ClusterState, Cursor
from gpudaemon.cluster.scoring import MAX_SCORE
from gpudaemon.cluster.state import NodeState


def strands_no_gpu(node: NodeState | None) -> bool:
    """No GPU or MIG device of the node is free (a node the caches do not know has
    none that gpudaemon schedules)."""
    return node is None or (node.gpus_free <= 0 and not any(node.mig_free.values()))


class FullNodesFirst:
    """Per node: does it strand no GPU? Kept current from the cluster's change log."""

    def __init__(self, cluster: ClusterState) -> None:
        self.cluster = cluster
        self._lock = threading.Lock()
        self._cursor: Cursor | None = None
        self._full: dict[str, bool] = {}

    def scores(self, names: Sequence[str]) -> list[tuple[str, int]]:
        with self._lock:
            full = self._full
            missing = [n for n in names if n not in full]
            ch = self.cluster.changes(self._cursor, missing)
            self._cursor = ch.cursor
            if ch.changed is None:  # every node again
                full.clear()
            for n, st in ch.states.items():
                if st is None:  # kept only for nodes the caches know: bounded
                    full.pop(n, None)
                else:
                    full[n] = strands_no_gpu(st)
            return [(n, MAX_SCORE if full.get(n, True) else 0) for n in names]
