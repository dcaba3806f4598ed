"""Filter `healthy`: no lost or XID/ECC-failed GPU on the node (the node will likely be
drained and rebooted). Off when `extender.avoid_unhealthy_nodes` is false."""

from __future__ import annotations

from collections.abc import Mapping

from gpudaemon.cluster.checks import Rejection, healthy
from gpudaemon.cluster.state import NodeState
from gpudaemon.extender.plugins.base import Cycle, Handle, NodeFilter, PluginSpec, register


def healthy_nodes(
    names: list[str],
    states: Mapping[str, NodeState | None],
    fresh: Mapping[str, bool],
    failed: dict[str, Rejection],
) -> list[str]:
    out = []
    for n in names:
        st = states[n]
        if (
            st is None or st.gpus_unhealthy <= 0 or (why := healthy(st)) is None
        ):  # what `healthy` passes, inline
            out.append(n)
        else:
            failed[n] = why
    return out


class Healthy:
    name = "healthy"
    # Its filter judges a node by its state and freshness alone (and the pod's shape):
    # the framework may keep its verdicts between requests (extender/verdicts.py).
    pure = True

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def prepare(self, cycle: Cycle) -> NodeFilter | None:
        return healthy_nodes if self.enabled else None


def _new(handle: Handle) -> Healthy:
    return Healthy(handle.avoid_unhealthy)


register(PluginSpec("healthy", "filter", _new, "no unhealthy GPU on the node"))
