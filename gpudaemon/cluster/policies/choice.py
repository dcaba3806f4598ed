"""Which policy scores a pod: the one rule the extender (its `policy` score plug-in)
and the rebalancer (where it foresees a moved pod landing) both follow.

The policy the pod's `gpudaemon.io/policy` annotation names; else `migpack` for a pod
asking for MIG devices alone (when it is registered); else the default
(`extender.policy`). An annotation naming no registered policy is an error, not a
silent fallback: the extender fails every node for such a pod, with this message.
"""

from __future__ import annotations

from collections.abc import Mapping

from gpudaemon.cluster.podspec import POLICY_ANNOTATION
from gpudaemon.cluster.policies.base import Policy
from gpudaemon.cluster.state import PodShape

MIG_POLICY = "migpack"  # pods of MIG devices alone, unless their annotation says otherwise


class UnknownPodPolicy(ValueError):
    """The pod's annotation names no registered policy: every node fails with this."""

    def __init__(self, chosen: str, known: Mapping[str, Policy]) -> None:
        self.chosen = chosen
        super().__init__(
            f"gpudaemon: unknown policy {chosen!r} in annotation {POLICY_ANNOTATION}"
            f" (known: {', '.join(sorted(known))})"
        )


def choose_policy(
    chosen: str | None,
    shape: PodShape | None,
    policies: Mapping[str, Policy],
    default: Policy,
) -> Policy:
    """The pod's policy. `chosen`: its annotation as `podspec.pod_policy` reads it
    (None: none); `shape`: its requests (None: not known, so not a MIG pod)."""
    if chosen is None:
        if shape is not None and shape.mig and not shape.gpus and MIG_POLICY in policies:
            return policies[MIG_POLICY]
        return default
    policy = policies.get(chosen)
    if policy is None:
        raise UnknownPodPolicy(chosen, policies)
    return policy
