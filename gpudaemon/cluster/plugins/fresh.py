"""Filter `fresh`: the node's agent data is readable, present and fresh (its Lease
renewed): otherwise nothing we know of its GPUs can be trusted."""

from __future__ import annotations

from collections.abc import Mapping

from gpudaemon.cluster.checks import Rejection, agent_data
from gpudaemon.cluster.plugins.base import CycleState, Handle, NodeFilter, PluginSpec
from gpudaemon.cluster.state import NodeState


def fresh_nodes(
    names: list[str],
    states: Mapping[str, NodeState | None],
    fresh: Mapping[str, bool],
    failed: dict[str, Rejection],
) -> list[str]:
    out = []
    for n in names:
        st = states[n]
        # What agent_data passes, read inline (no call per node); it names the rest.
        if (st is not None and fresh[n] and st.has_agent_labels and not st.bad_data) or (
            why := agent_data(st, fresh[n])
        ) is None:
            out.append(n)
        else:
            failed[n] = why
    return out


class Fresh:
    name = "fresh"
    # Its filter judges a node by its state and freshness alone (and the pod's shape):
    # the framework may keep its verdicts between requests (extender/verdicts.py).
    pure = True

    def filter(self, state: CycleState) -> NodeFilter | None:
        return fresh_nodes


def _new(handle: Handle, args: object) -> Fresh:
    return Fresh()


SPEC = PluginSpec("fresh", "filter", _new, "agent data readable, present and fresh")
