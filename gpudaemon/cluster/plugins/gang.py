"""Score tier `gang`: a gang pod's nodes ranked by its gang's tiers (scoring.gang_scores:
same node as the gang, room for the whole rest of the gang, same GPU product), compared
before the score plug-ins' sum. Its PreFilter gathers what the tiers read once per
request: the nodes holding the gang, their GPU products, and the GPUs of the gang still
to place (this pod and its pending siblings not yet placed)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpudaemon.cluster.clusterstate import ClusterState, Snapshot
from gpudaemon.cluster.plugins.base import (
    POD,
    CycleState,
    Handle,
    PendingView,
    PluginSpec,
    StateKey,
)
from gpudaemon.cluster.scoring import Gang, gang_scores

GANG: StateKey[Gang] = StateKey("gang")


class GangTiers:
    name = "gang"

    def __init__(self, cluster: ClusterState, pending: PendingView | None) -> None:
        self.cluster = cluster
        self.pending = pending

    def pre_filter(self, state: CycleState) -> None:
        real = state.read(POD).real
        if real is None or not real.gang:
            return
        uid, shape, gang = real
        cluster = self.cluster
        held = cluster.gang_nodes(gang)
        remaining = shape.gpus
        if self.pending is not None:
            remaining += sum(
                p.shape.gpus
                for p in self.pending.gang_members(gang)
                if p.uid != uid and not cluster.is_assumed(p.uid)
            )
        # A node the gang filled is often not in the request (the scheduler's filter
        # dropped it), yet its product is the gang's: read it from the cache.
        states = cluster.states(held) if held else {}
        products = frozenset(st.gpu_model for st in states.values() if st is not None)
        state.write(GANG, Gang(held, products, remaining, shape.gpus))

    def has_say(self, state: CycleState, degraded: bool) -> bool:
        return state.get(GANG) is not None

    def order(
        self, state: CycleState, scores: Mapping[str, Any], snap: Snapshot
    ) -> Mapping[str, Any]:
        gang = state.get(GANG)
        if gang is None or not scores:
            return scores
        return gang_scores(scores, snap.states, gang)


def _new(handle: Handle, args: object) -> GangTiers:
    return GangTiers(handle.cluster, handle.pending)


SPEC = PluginSpec(
    "gang",
    "tier",
    _new,
    "a gang pod: nodes holding its gang, then room for the rest of it, then its GPU product",
)
