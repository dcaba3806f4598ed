"""The PreFilter, filter, score, tier and reserve plug-ins: one module each (base.py
has the interfaces and the cycle state; registry.py lists every plug-in by name in one
table; combine.py sums the scores with their weights and puts the tiers in front).
`extender.plugins` in the config enables them by name. The extender runs the whole
profile per request; the rebalancer runs its filters, scores and tiers to foresee
where the extender would place a pod (rebalancer/planner.py `Placer`)."""

from __future__ import annotations

from gpudaemon.cluster.plugins.base import (
    BY_POD,
    KINDS,
    MAX_NODE_SCORE,
    POD,
    Cycle,
    CycleState,
    FilterPlugin,
    Handle,
    Kind,
    MissingStateError,
    NodeCheck,
    NodeFilter,
    NodeScore,
    PendingPod,
    PendingView,
    PluginSpec,
    PreFilterPlugin,
    RealPod,
    ReservePlugin,
    ScorePlugin,
    StateKey,
    TierPlugin,
    per_node,
)
from gpudaemon.cluster.plugins.combine import tiered, weighted_sum
from gpudaemon.cluster.plugins.registry import (
    BUILT_IN,
    Profile,
    UnknownPluginError,
    build_profile,
    check_plugins,
    known_plugins,
    plugin_spec,
    register,
    registered,
    unregister,
)

__all__ = [
    "BUILT_IN",
    "BY_POD",
    "KINDS",
    "MAX_NODE_SCORE",
    "POD",
    "Cycle",
    "CycleState",
    "FilterPlugin",
    "Handle",
    "Kind",
    "MissingStateError",
    "NodeCheck",
    "NodeFilter",
    "NodeScore",
    "PendingPod",
    "PendingView",
    "PluginSpec",
    "PreFilterPlugin",
    "Profile",
    "RealPod",
    "ReservePlugin",
    "ScorePlugin",
    "StateKey",
    "TierPlugin",
    "UnknownPluginError",
    "build_profile",
    "check_plugins",
    "known_plugins",
    "per_node",
    "plugin_spec",
    "register",
    "registered",
    "tiered",
    "unregister",
    "weighted_sum",
]
