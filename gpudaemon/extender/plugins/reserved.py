"""Filter `reserved`: the room the rebalancer keeps on a node for another pending pod
(it evicted pods to make it, and said so on its Lease), which a pod of no higher
priority may not take. Honoured only with the pending-pods cache (a verifier), so only
for pods seen unbound."""

from __future__ import annotations

from collections.abc import Sequence

from gpudaemon.cluster.checks import Rejection
from gpudaemon.cluster.reservations import LeaseReservations, Reservation, held_on
from gpudaemon.cluster.state import NodeState, PodShape
from gpudaemon.extender.plugins.base import (
    Cycle,
    Handle,
    NodeFilter,
    PluginSpec,
    per_node,
    register,
)
from gpudaemon.extender.pods import PendingPods, priority_of


class Reserved:
    name = "reserved"

    def __init__(self, pending: PendingPods | None, reservations: LeaseReservations | None):
        self.pending = pending
        self.reservations = reservations

    def prepare(self, cycle: Cycle) -> NodeFilter | None:
        pending, now = self.pending, cycle.now
        if self.reservations is None or pending is None:
            return None
        kept = self.reservations.in_force(now)  # node -> the room kept there
        if not kept:  # the usual case: no check per node at all
            return None
        uid, shape = cycle.uid, cycle.shape
        known = pending.get(uid) if uid else None
        priority = known.priority if known is not None else priority_of(cycle.pod)

        def check(node: NodeState | None, fresh: bool) -> Rejection | None:
            here = kept.get(node.name) if node is not None else None
            if not here:
                return None
            return kept_for_another(pending, here, node, shape, uid, priority, now)

        return per_node(check)


def kept_for_another(
    pending: PendingPods,
    here: Sequence[Reservation],
    st: NodeState | None,
    shape: PodShape,
    uid: str,
    priority: int,
    now: float,
) -> Rejection | None:
    """`here`: the Lease's reservations on this node."""
    held, holder = held_on(here, uid, priority, now, pending.get)
    if not held or st is None or shape.gpus <= st.gpus_free_bound - held:
        return None
    return Rejection(
        "reserved",
        f"{held} GPU(s) kept for pending pod {holder} (gpudaemon rebalancer made room for it)",
    )


def _new(handle: Handle) -> Reserved:
    return Reserved(handle.pending, handle.reservations)


register(PluginSpec("reserved", "filter", _new, "room the rebalancer keeps for a pending pod"))
