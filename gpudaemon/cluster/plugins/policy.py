"""Score `policy`: each pod's own policy (cluster/policies/): the one its
gpudaemon.io/policy annotation names, else migpack for a pod of MIG devices alone,
else `extender.policy`. The framework resolves it per request (Cycle.policy). Every
registered policy is also a score plug-in under its own name (`FixedPolicy`), scoring
every pod by that policy, whatever the pod's annotation says."""

from __future__ import annotations

from gpudaemon.cluster.plugins.base import POD, CycleState, Handle, PluginSpec
from gpudaemon.cluster.policies.base import Policy
from gpudaemon.cluster.scoring import Scorer


class PodPolicy:
    name = "policy"

    def scorer(self, state: CycleState) -> Scorer | None:
        cycle = state.read(POD)
        p = cycle.policy
        # A GPU-less pod reaches us only without managedResources; neutral unless the
        # policy judges where it strands GPUs (fragmentation does).
        return p if cycle.shape.wants_gpus or p.scores_gpuless_pods else None


class FixedPolicy:
    """A policy as a score plug-in under its own name."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.name = policy.name

    def scorer(self, state: CycleState) -> Scorer | None:
        p = self.policy
        return p if state.read(POD).shape.wants_gpus or p.scores_gpuless_pods else None


def fixed_policy_spec(name: str) -> PluginSpec:
    """The score plug-in of the registered policy `name`."""
    return PluginSpec(name, "score", lambda h, _: FixedPolicy(h.policies[name]), "a policy")


def _new(handle: Handle, args: object) -> PodPolicy:
    return PodPolicy()


SPEC = PluginSpec("policy", "score", _new, "the pod's policy (annotation, MIG, default)")
