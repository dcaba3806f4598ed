"""Scoring policies: one module each, pure functions from (node, pod) to a raw score.

A raw score only has to order nodes (higher is better); `scoring.to_levels` maps the
order onto the scheduler's 0-10 scale.
"""

from __future__ import annotations

from gpudaemon.extender.policies.base import Policy
from gpudaemon.extender.policies.binpack import BinPack
from gpudaemon.extender.policies.spread import Spread

__all__ = ["BinPack", "Policy", "Spread"]
