"""Score tier `healthy_gpus`: a node that can give the pod enough free GPUs that are
not degraded ranks above one that would have to use a degraded GPU
(scoring.prefer_healthy), compared before the gang tiers and the score plug-ins' sum.
Nothing is computed while no node has a free degraded GPU. Its argument `enabled`
defaults to `extender.prefer_healthy_gpus`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict

from gpudaemon.cluster.clusterstate import Snapshot
from gpudaemon.cluster.plugins.base import POD, CycleState, Handle, PluginSpec
from gpudaemon.cluster.scoring import prefer_healthy
from gpudaemon.config.values import Switch


class HealthyGpusArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # false: degraded GPUs rank as any other free GPU.
    enabled: Switch = True


class HealthyGpus:
    name = "healthy_gpus"

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def has_say(self, state: CycleState, degraded: bool) -> bool:
        return self.enabled and degraded

    def order(
        self, state: CycleState, scores: Mapping[str, Any], snap: Snapshot
    ) -> Mapping[str, Any]:
        if not self.enabled or not snap.degraded:
            return scores
        cycle = state.read(POD)
        gpus = cycle.real.shape.gpus if cycle.real is not None else cycle.shape.gpus
        return prefer_healthy(scores, snap.states, snap.degraded, gpus)


def _new(handle: Handle, args: HealthyGpusArgs) -> HealthyGpus:
    return HealthyGpus(args.enabled)


SPEC = PluginSpec(
    "healthy_gpus",
    "tier",
    _new,
    "free GPUs that are not degraded before degraded ones",
    HealthyGpusArgs,
    lambda handle: {"enabled": handle.prefer_healthy_gpus},
)
