"""What the rebalancer would evict, and why: pure functions of the cluster as the
extender sees it (its `NodeState`s, free-GPU count and policies) and of the pods.

- **drain**: pods holding a GPU the agent reports unhealthy, once it has been so for
  the grace period, on nodes whose agent data is fresh;
- **defragment**: for a pending GPU pod that fits on no node, the fewest evictions on
  one node that make it fit, where every evicted pod fits on another node now (placed
  by the extender's own policy, one after the other). All or nothing, as KAI-Scheduler's
  Consolidate: a plan that does not hold is not started.

Nothing here calls the API; `app.py` acts on the plans.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from gpudaemon.extender.app import unschedulable_since
from gpudaemon.extender.podspec import pod_gang, pod_shape
from gpudaemon.extender.policies.base import Policy
from gpudaemon.extender.scoring import check_node
from gpudaemon.extender.state import NodeState, PodShape

OPT_IN_ANNOTATION = "gpudaemon.io/rebalance"


@dataclass(frozen=True)
class NodeFacts:
    """What placement needs beyond NodeState: the Node's labels and taints."""

    labels: Mapping[str, str] = field(default_factory=dict)
    taints: tuple[tuple[str, str, str], ...] = ()  # (key, value, effect)


@dataclass(frozen=True)
class PodFacts:
    """One pod, as the planner needs it."""

    uid: str
    namespace: str
    name: str
    node: str  # "" while pending
    shape: PodShape
    priority: int = 0
    owned: bool = False  # a controller (ReplicaSet, Job, StatefulSet, ...) re-creates it
    opted_in: bool = False  # annotation gpudaemon.io/rebalance="true" or the selector
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    # Required node affinity other than on the GPU product, which the planner cannot
    # judge: such a pod is never moved, and never made room for.
    other_affinity: bool = False
    terminating: bool = False  # deleted (or evicted) already: its GPUs free up soon
    # Pending only: the scheduler tried it and found no node (PodScheduled=False).
    unschedulable: bool = False
    gang: str = ""  # "ns/podgroup" (scheduling.x-k8s.io/pod-group), "" when none

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


def pod_facts(
    obj: Mapping[str, Any], product_label: str, selector: Callable[[Mapping[str, str]], bool]
) -> PodFacts | None:
    """The pod's facts, or None when its resources cannot be read."""
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    try:
        shape = pod_shape(obj, product_label)
    except (ValueError, AttributeError, TypeError):
        return None
    labels = meta.get("labels") or {}
    ann = meta.get("annotations") or {}
    owners = meta.get("ownerReferences") or []
    affinity = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    other = any(
        e.get("key") != product_label
        for t in affinity.get("nodeSelectorTerms") or []
        for e in (t.get("matchExpressions") or []) + (t.get("matchFields") or [])
    )
    priority = spec.get("priority")
    return PodFacts(
        uid=str(meta.get("uid") or ""),
        namespace=str(meta.get("namespace") or ""),
        name=str(meta.get("name") or ""),
        node=str(spec.get("nodeName") or ""),
        shape=shape,
        priority=priority if isinstance(priority, int) else 0,
        owned=any(o.get("controller") is True for o in owners),
        opted_in=ann.get(OPT_IN_ANNOTATION) == "true" or selector(labels),
        node_selector={
            k: v for k, v in (spec.get("nodeSelector") or {}).items() if k != product_label
        },
        tolerations=tuple(spec.get("tolerations") or ()),
        other_affinity=other,
        terminating=bool(meta.get("deletionTimestamp")),
        unschedulable=unschedulable_since(obj) is not None,
        gang=pod_gang(obj),
    )


def node_facts(obj: Mapping[str, Any]) -> NodeFacts:
    meta = obj.get("metadata") or {}
    taints = tuple(
        (str(t.get("key", "")), str(t.get("value", "")), str(t.get("effect", "")))
        for t in (obj.get("spec") or {}).get("taints") or []
        if t.get("effect") in ("NoSchedule", "NoExecute")
    )
    return NodeFacts(labels=dict(meta.get("labels") or {}), taints=taints)


def tolerates(pod: PodFacts, taint: tuple[str, str, str]) -> bool:
    key, value, effect = taint
    for t in pod.tolerations:
        if t.get("effect") not in (None, "", effect):
            continue
        if t.get("operator") == "Exists" and t.get("key") in (None, "", key):
            return True
        if t.get("key") == key and str(t.get("value", "")) == value:
            return True
    return False


def may_land(pod: PodFacts, facts: NodeFacts | None) -> bool:
    """nodeSelector and taints allow the pod on the node (GPU product: NodeState)."""
    if facts is None:
        return False
    if any(facts.labels.get(k) != v for k, v in pod.node_selector.items()):
        return False
    return all(tolerates(pod, t) for t in facts.taints)


# -- drain ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    """One pod the rebalancer would evict, or will not: `reason` is a metric label."""

    pod: PodFacts
    kind: str  # "drain" | "defrag"
    reason: str  # evict: "unhealthy_gpu", "make_room"; skip: "bare_pod", "stale", ...
    message: str
    evict: bool


def drain(
    sick: Iterable[tuple[str, int, str, float, Sequence[str]]],
    pods: Mapping[str, PodFacts],
    fresh: Mapping[str, bool],
    grace_s: float,
) -> list[Decision]:
    """`sick`: (node, GPU index, reason, seconds unhealthy, holders "ns/name") per GPU the
    agent reports unhealthy. Pods on stale nodes and before the grace period are left."""
    out: list[Decision] = []
    seen: set[str] = set()
    for node, index, why, for_s, holders in sick:
        for key in holders:
            pod = pods.get(key)
            if pod is None or key in seen or pod.node != node or pod.terminating:
                continue  # gone, judged, going, or the annotation is older than the move
            seen.add(key)
            gpu = f"GPU {index} on {node} is unhealthy ({why})"
            if not fresh.get(node, False):
                out.append(
                    Decision(pod, "drain", "stale", f"{gpu}, but the agent data is stale", False)
                )
            elif for_s < grace_s:
                continue  # not yet: no event for every pass of the grace period
            elif not pod.owned:
                msg = f"{gpu}; not evicted: a bare pod (no controller would re-create it)"
                out.append(Decision(pod, "drain", "bare_pod", msg, False))
            else:
                msg = f"{gpu} for {for_s:.0f} s; evicting so its controller re-creates it elsewhere"
                out.append(Decision(pod, "drain", "unhealthy_gpu", msg, True))
    return out


# -- defragment -----------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """Evict `victims` from `node` so `pending` fits there; each victim's new node."""

    pending: PodFacts
    node: str
    victims: tuple[PodFacts, ...]
    targets: tuple[str, ...]

    @property
    def cost(self) -> tuple[int, int, str]:
        return (len(self.victims), sum(v.shape.gpus for v in self.victims), self.node)


def fits_now(
    pod: PodFacts,
    states: Mapping[str, NodeState | None],
    fresh: Mapping[str, bool],
    facts: Mapping[str, NodeFacts],
) -> bool:
    return any(
        st is not None
        and check_node(st, pod.shape, fresh=fresh.get(n, False)) is None
        and st.can_host(pod.shape)
        and may_land(pod, facts.get(n))
        for n, st in states.items()
    )


def _without(st: NodeState, pods: Sequence[PodFacts]) -> NodeState:
    return replace(
        st,
        gpus_requested=st.gpus_requested - sum(p.shape.gpus for p in pods),
        cpu_requested_milli=st.cpu_requested_milli - sum(p.shape.cpu_milli for p in pods),
        memory_requested_bytes=st.memory_requested_bytes - sum(p.shape.memory_bytes for p in pods),
    )


def defragment(
    pending: PodFacts,
    states: Mapping[str, NodeState | None],
    fresh: Mapping[str, bool],
    facts: Mapping[str, NodeFacts],
    running: Mapping[str, Sequence[PodFacts]],
    policy: Policy,
) -> Plan | None:
    """The cheapest plan that makes room for `pending`, or None. Whole GPUs only."""
    if pending.shape.gpus <= 0 or pending.shape.mig or pending.other_affinity:
        return None
    if pending.gang or not pending.unschedulable:
        return None  # a gang needs room for all its pods; an untried pod may fit yet
    if fits_now(pending, states, fresh, facts):
        return None  # the scheduler will place it; nothing to move
    best: Plan | None = None
    for node, st in sorted(states.items()):
        if st is None or not fresh.get(node, False) or not may_land(pending, facts.get(node)):
            continue
        why = check_node(st, PodShape(0), fresh=True)
        if why is not None or st.gpus_allocatable - st.gpus_unhealthy < pending.shape.gpus:
            continue  # no agent, stale or sick, or too small even when empty
        need = pending.shape.gpus - st.gpus_free
        movable = sorted(
            (
                p
                for p in running.get(node, ())
                if p.opted_in and p.owned and not p.other_affinity and not p.terminating
                and p.priority <= pending.priority and p.shape.gpus > 0 and not p.shape.mig
            ),
            key=lambda p: (-p.shape.gpus, p.key),
        )  # fmt: skip
        victims: list[PodFacts] = []
        for p in movable:  # the largest first: the fewest evictions that free enough
            if sum(v.shape.gpus for v in victims) >= need:
                break
            victims.append(p)
        if sum(v.shape.gpus for v in victims) < need:
            continue
        if not _without(st, victims).can_host(pending.shape):
            continue  # the GPUs would be free, but not the CPU or memory
        targets = _replace_elsewhere(victims, node, states, fresh, facts, policy)
        if targets is None:
            continue
        plan = Plan(pending, node, tuple(victims), tuple(targets))
        if best is None or plan.cost < best.cost:
            best = plan
    return best


def _replace_elsewhere(
    victims: Sequence[PodFacts],
    source: str,
    states: Mapping[str, NodeState | None],
    fresh: Mapping[str, bool],
    facts: Mapping[str, NodeFacts],
    policy: Policy,
) -> list[str] | None:
    """Where each victim would go now (by the policy, one after the other), or None if
    one fits nowhere but the node it leaves."""
    sim = {n: st for n, st in states.items() if st is not None and n != source}
    targets = []
    for v in victims:
        scored = {
            n: policy.raw_score(st, v.shape)
            for n, st in sim.items()
            if check_node(st, v.shape, fresh=fresh.get(n, False)) is None
            and st.can_host(v.shape)
            and may_land(v, facts.get(n))
        }
        if not scored:
            return None
        top = max(scored.values())
        chosen = min(n for n, s in scored.items() if s == top)
        sim[chosen] = sim[chosen].with_placed(v.shape)
        targets.append(chosen)
    return targets
