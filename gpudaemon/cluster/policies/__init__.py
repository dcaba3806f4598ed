"""Scoring policies: one module each, registered by name (base.py has the registry).

Every module in this package is imported here, so a new policy file registers itself
with no other edit. A raw score only has to order nodes (higher is better);
`scoring.to_levels` maps the order onto the scheduler's 0-10 scale.
"""

from __future__ import annotations

from gpudaemon.cluster.policies.base import (
    Policy,
    PolicySpec,
    UnknownPolicyError,
    build_policies,
    known_policies,
    policy_spec,
    register,
    unregister,
)
from gpudaemon.registry import import_modules

import_modules(__name__, __path__)

from gpudaemon.cluster.policies.binpack import BinPack  # noqa: E402
from gpudaemon.cluster.policies.spread import Spread  # noqa: E402

__all__ = [
    "BinPack",
    "Policy",
    "PolicySpec",
    "Spread",
    "UnknownPolicyError",
    "build_policies",
    "known_policies",
    "policy_spec",
    "register",
    "unregister",
]
