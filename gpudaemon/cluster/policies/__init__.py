"""Scoring policies: one module each (base.py has the interface; registry.py lists
every policy by name in one table). A raw score only has to order nodes (higher is
better); `scoring.to_levels` maps the order onto the scheduler's 0-10 scale.
"""

from __future__ import annotations

from gpudaemon.cluster.policies.base import Policy, PolicySpec
from gpudaemon.cluster.policies.binpack import BinPack
from gpudaemon.cluster.policies.choice import MIG_POLICY, UnknownPodPolicy, choose_policy
from gpudaemon.cluster.policies.registry import (
    BUILT_IN,
    UnknownPolicyError,
    build_policies,
    known_policies,
    policy_spec,
    register,
    unregister,
)
from gpudaemon.cluster.policies.spread import Spread

__all__ = [
    "BUILT_IN",
    "MIG_POLICY",
    "BinPack",
    "Policy",
    "PolicySpec",
    "Spread",
    "UnknownPodPolicy",
    "UnknownPolicyError",
    "build_policies",
    "choose_policy",
    "known_policies",
    "policy_spec",
    "register",
    "unregister",
]
