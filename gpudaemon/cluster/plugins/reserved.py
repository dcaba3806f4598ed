"""Filter `reserved`: the room the rebalancer keeps on a node for another pending pod
(it evicted pods to make it, and said so on its Lease), which a pod of no higher
priority may not take. Honoured only with the program's pending pods: in the extender
with its verifier's cache, and the rooms read from the rebalancer's Lease; in the
rebalancer (foreseeing where a moved pod lands) with its own pending pods and the
rooms it keeps itself."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from gpudaemon.cluster.checks import Rejection
from gpudaemon.cluster.plugins.base import (
    BY_POD,
    POD,
    CycleState,
    Handle,
    NodeFilter,
    PendingView,
    PluginSpec,
    StateKey,
    per_node,
)
from gpudaemon.cluster.podspec import pod_priority
from gpudaemon.cluster.reservations import KeptRooms, Reservation, held_on
from gpudaemon.cluster.state import NodeState, PodShape


class Kept(NamedTuple):
    rooms: Mapping[str, Sequence[Reservation]]  # node -> the Lease's reservations there
    priority: int  # the pod's


KEPT: StateKey[Kept] = StateKey("reserved")


class Reserved:
    name = "reserved"

    def __init__(self, pending: PendingView | None, reservations: KeptRooms | None):
        self.pending = pending
        self.reservations = reservations

    def pre_filter(self, state: CycleState) -> None:
        """The rooms in force now, and the pod's priority: read once per request."""
        pending = self.pending
        if self.reservations is None or pending is None:
            return
        cycle = state.read(POD)
        kept = self.reservations.in_force(cycle.now)  # node -> the room kept there
        if not kept:  # the usual case: no check per node at all
            return
        uid = cycle.uid
        known = pending.get(uid) if uid else None
        priority = known.priority if known is not None else pod_priority(cycle.pod)
        state.write(KEPT, Kept(kept, priority))
        # What its verdicts depend on beyond its requests: its priority, and its UID
        # only where a room is its own.
        own = any(r.uid == uid for rooms in kept.values() for r in rooms) if uid else False
        state.write(BY_POD, (priority, uid if own else ""))

    def filter(self, state: CycleState) -> NodeFilter | None:
        here_kept = state.get(KEPT)
        if here_kept is None or self.pending is None:
            return None
        pending, kept, priority = self.pending, here_kept.rooms, here_kept.priority
        cycle = state.read(POD)
        uid, shape, now = cycle.uid, cycle.shape, cycle.now

        def check(node: NodeState | None, fresh: bool) -> Rejection | None:
            here = kept.get(node.name) if node is not None else None
            if not here:
                return None
            return kept_for_another(pending, here, node, shape, uid, priority, now)

        return per_node(check)


def kept_for_another(
    pending: PendingView,
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


def _new(handle: Handle, args: object) -> Reserved:
    return Reserved(handle.pending, handle.reservations)


SPEC = PluginSpec("reserved", "filter", _new, "room the rebalancer keeps for a pending pod")
