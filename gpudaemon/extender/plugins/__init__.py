"""The extender's filter, score and reserve plug-ins: one module each, registered by
name (base.py has the interfaces and the registry).

Every module in this package is imported here, so a new plug-in file registers itself
with no other edit; `extender.plugins` in the config enables it by name.
"""

from __future__ import annotations

from gpudaemon.extender.plugins.base import (
    KINDS,
    MAX_NODE_SCORE,
    Cycle,
    FilterPlugin,
    Handle,
    NodeCheck,
    NodeFilter,
    NodeScore,
    PluginSpec,
    Profile,
    ReservePlugin,
    ScorePlugin,
    UnknownPluginError,
    build_profile,
    check_plugins,
    known_plugins,
    per_node,
    plugin_spec,
    register,
    unregister,
)
from gpudaemon.registry import import_modules

import_modules(__name__, __path__)

__all__ = [
    "KINDS",
    "MAX_NODE_SCORE",
    "Cycle",
    "FilterPlugin",
    "Handle",
    "NodeCheck",
    "NodeFilter",
    "NodeScore",
    "PluginSpec",
    "Profile",
    "ReservePlugin",
    "ScorePlugin",
    "UnknownPluginError",
    "build_profile",
    "check_plugins",
    "known_plugins",
    "per_node",
    "plugin_spec",
    "register",
    "unregister",
]
