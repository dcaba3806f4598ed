"""Filter `healthy`: no lost or XID/ECC-failed GPU on the node (the node will likely be
drained and rebooted). Its argument `enabled` defaults to
`extender.avoid_unhealthy_nodes`."""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict

from gpudaemon.cluster.checks import Rejection, healthy
from gpudaemon.cluster.plugins.base import CycleState, Handle, NodeFilter, PluginSpec
from gpudaemon.cluster.state import NodeState
from gpudaemon.config.values import Switch


def healthy_nodes(
    names: list[str],
    states: Mapping[str, NodeState | None],
    fresh: Mapping[str, bool],
    failed: dict[str, Rejection],
) -> list[str]:
    out = []
    for n in names:
        st = states[n]
        if (
            st is None or st.gpus_unhealthy <= 0 or (why := healthy(st)) is None
        ):  # what `healthy` passes, inline
            out.append(n)
        else:
            failed[n] = why
    return out


class HealthyArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # false: a node with a failed GPU is not turned away (it may still be ranked).
    enabled: Switch = True


class Healthy:
    name = "healthy"
    # Its filter judges a node by its state and freshness alone (and the pod's shape):
    # the framework may keep its verdicts between requests (extender/verdicts.py).
    pure = True

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def filter(self, state: CycleState) -> NodeFilter | None:
        return healthy_nodes if self.enabled else None


def _new(handle: Handle, args: HealthyArgs) -> Healthy:
    return Healthy(args.enabled)


SPEC = PluginSpec(
    "healthy",
    "filter",
    _new,
    "no unhealthy GPU on the node",
    HealthyArgs,
    lambda handle: {"enabled": handle.avoid_unhealthy},
)
