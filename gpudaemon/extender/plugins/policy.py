"""Score `policy`: each pod's own policy (cluster/policies/): the one its
gpudaemon.io/policy annotation names, else migpack for a pod of MIG devices alone,
else `extender.policy`. The framework resolves it per request (Cycle.policy)."""

from __future__ import annotations

from gpudaemon.cluster.scoring import Scorer
from gpudaemon.extender.plugins.base import Cycle, Handle, PluginSpec, register


class PodPolicy:
    name = "policy"

    def scorer(self, cycle: Cycle) -> Scorer | None:
        p = cycle.policy
        # A GPU-less pod reaches us only without managedResources; neutral unless the
        # policy judges where it strands GPUs (fragmentation does).
        return p if cycle.shape.wants_gpus or p.scores_gpuless_pods else None


def _new(handle: Handle) -> PodPolicy:
    return PodPolicy()


register(PluginSpec("policy", "score", _new, "the pod's policy (annotation, MIG, default)"))
