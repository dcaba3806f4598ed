"""How a profile's scores become one order, shared by the extender (framework.py) and
the rebalancer's placement (rebalancer/planner.py), so both rank nodes by one rule:
each score plug-in's raw scores normalised to 0..MAX_NODE_SCORE over the nodes ranked
and summed with the weights (kube-scheduler's rule), then the tier plug-ins' ordered
comparison in front of the sum, the first configured compared first."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpudaemon.cluster.clusterstate import Snapshot
from gpudaemon.cluster.plugins.base import MAX_NODE_SCORE, CycleState, TierPlugin


def weighted_sum(parts: Sequence[tuple[dict[str, float], int]]) -> dict[str, float]:
    """One score per node from (raw scores by node, weight) per score plug-in. Only
    nodes every plug-in scored are ranked (a plug-in leaves out a node that cannot host
    the pod). With one plug-in its raw scores are used as they are: a positive affine
    map keeps their order, and skipping it keeps close raw scores from merging in float
    rounding."""
    if not parts:
        return {}
    if len(parts) == 1:
        return parts[0][0]
    common = set(parts[0][0])
    for raw, _ in parts[1:]:
        common.intersection_update(raw)
    total = dict.fromkeys(common, 0.0)
    if not common:
        return total
    for raw, weight in parts:
        values = [raw[n] for n in common]
        lo, span = min(values), max(values) - min(values)
        if span <= 0:  # all equal: every node the plug-in's top score
            for n in common:
                total[n] += weight * MAX_NODE_SCORE
            continue
        k = weight * MAX_NODE_SCORE / span
        for n in common:
            total[n] += k * (raw[n] - lo)
    return total


def tiered(
    tiers: Sequence[TierPlugin], state: CycleState, scores: Mapping[str, Any], snap: Snapshot
) -> Mapping[str, Any]:
    """What the nodes are ranked by: the tier plug-ins' preferences, the first
    configured compared first, then `scores` (an ordered comparison: a tier with no say
    on this pod gives the scores back unchanged)."""
    ranked: Mapping[str, Any] = scores
    for tier in reversed(tiers):
        ranked = tier.order(state, ranked, snap)
    return ranked


__all__ = ["tiered", "weighted_sum"]
