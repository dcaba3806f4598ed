"""Which pods a sick GPU's verdict takes off it: pure, as the rest of the planner. The
verdict's action decides (`drain`, `reset_gpu`, `reboot_node`: every GPU pod of the
node, `replace`; an older agent's unhealthy GPU: `drain`), once it has needed so for
the grace period, on nodes whose agent data is fresh; never `watch` (degraded)."""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from gpudaemon.labels.annotations import GpuState
from gpudaemon.rebalancer.planner import Decision, PodFacts

# The verdict's actions (health/verdict.py ACTIONS) that take the GPU's pods off it: the
# GPU is about to be reset, rebooted with its node, or replaced, or its peer-to-peer
# traffic must stop. `none` and `watch` (a degraded GPU) leave its pods alone.
DRAIN_ACTIONS = ("drain", "reset_gpu", "reboot_node", "replace")
NO_DRAIN_ACTIONS = ("none", "watch")


def drain_action(g: GpuState) -> str:
    """The action the GPU's pods are drained for, "" for none. An older agent writes no
    action: its unhealthy GPU is drained as before (`drain`); so is an unhealthy GPU
    whose action is newer than this table (whatever it is, the GPU is not usable)."""
    if g.action in DRAIN_ACTIONS:
        return g.action
    if not g.healthy and g.action not in NO_DRAIN_ACTIONS:
        return "drain"
    return ""


@dataclass(frozen=True)
class SickGpu:
    """A GPU whose action needs its pods off it, as `drain` judges it."""

    node: str
    index: int
    action: str  # one of DRAIN_ACTIONS
    reason: str  # the verdict's reason ("xid 79", "row remap pending")
    for_s: float  # seconds its action has needed a drain
    holders: Sequence[str] = ()  # "ns/name" from the agent's annotation
    uuid: str = ""

    @staticmethod
    def of(node: str, g: GpuState, for_s: float) -> SickGpu:
        return SickGpu(node, g.index, drain_action(g), g.reason or g.state, for_s, g.pods, g.uuid)


def with_claim_holders(
    sick: Iterable[SickGpu],
    pods: Mapping[str, PodFacts],
    holders: Callable[[str, str], Sequence[str]],
) -> list[SickGpu]:
    """Each sick GPU with the pods that hold one of its DRA devices through an allocated
    claim added to its holders (`holders(node, uuid)` gives their UIDs): the agent's
    annotation may not name them, and they are drained the same way."""
    by_uid: dict[str, str] | None = None
    out = []
    for g in sick:
        uids = holders(g.node, g.uuid)
        if uids:
            if by_uid is None:
                by_uid = {p.uid: key for key, p in pods.items()}
            extra = [k for u in uids if (k := by_uid.get(u)) and k not in g.holders]
            g = replace(g, holders=(*g.holders, *extra))
        out.append(g)
    return out


def drain(
    sick: Iterable[SickGpu],
    pods: Mapping[str, PodFacts],
    fresh: Mapping[str, bool],
    grace_s: float,
    *,
    grace_by_action: Mapping[str, float] | None = None,
    cordoned: Container[str] | None = None,
) -> list[Decision]:
    """`sick`: every GPU whose action needs a drain (`SickGpu.of`). Its holders go, and
    for `reboot_node` every pod of the node that asks for GPUs (the reboot takes them
    all, and the agent's holders may not list each). Pods on stale nodes and before the
    grace period are left; a pod is judged once, for the first GPU that names it.

    With remediation on (`cordoned` given), `reboot_node` takes the other GPUs' pods only
    once the node is cordoned, the sign that whatever reboots it has taken it; until
    then the healthy GPUs keep working. `grace_by_action` overrides the grace per action
    (a GPU that a reset will follow is drained sooner)."""
    out: list[Decision] = []
    seen: set[str] = set()
    by_node: dict[str, list[str]] | None = None
    for gpu in sick:
        node, action = gpu.node, gpu.action
        holders: Iterable[str] = gpu.holders
        whole_node = action == "reboot_node" and (cordoned is None or node in cordoned)
        if whole_node:
            if by_node is None:
                by_node = {}
                for key, p in pods.items():
                    if p.shape.wants_gpus:
                        by_node.setdefault(p.node, []).append(key)
            holders = [*gpu.holders, *sorted(by_node.get(node, ()))]
        for key in holders:
            pod = pods.get(key)
            if pod is None or key in seen or pod.node != node or pod.terminating:
                continue  # gone, judged, going, or the annotation is older than the move
            seen.add(key)
            what = f"GPU {gpu.index} on {node} needs {action} ({gpu.reason})"
            if whole_node:
                what += ": every GPU pod of the node goes"
            grace = (grace_by_action or {}).get(action, grace_s)
            if not fresh.get(node, False):
                msg = f"{what}, but the agent data is stale"
                out.append(Decision(pod, "drain", "stale", msg, False, action))
            elif gpu.for_s < grace:
                continue  # not yet: no event for every pass of the grace period
            elif not pod.owned:
                msg = f"{what}; not evicted: a bare pod (no controller would re-create it)"
                out.append(Decision(pod, "drain", "bare_pod", msg, False, action))
            else:
                msg = (f"{what}, for {gpu.for_s:.0f} s; evicting so its controller re-creates it"
                       " elsewhere")  # fmt: skip
                out.append(Decision(pod, "drain", "unhealthy_gpu", msg, True, action))
    return out
