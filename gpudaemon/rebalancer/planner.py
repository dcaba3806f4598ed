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


def _without(st: NodeState, pods: Sequence[PodFacts]) -> NodeState:
    return replace(
        st,
        gpus_requested=st.gpus_requested - sum(p.shape.gpus for p in pods),
        cpu_requested_milli=st.cpu_requested_milli - sum(p.shape.cpu_milli for p in pods),
        memory_requested_bytes=st.memory_requested_bytes - sum(p.shape.memory_bytes for p in pods),
    )


class Placer:
    """Where pods would land now, by the extender's policy, for one pass: for each
    placement signature (shape, nodeSelector, tolerations) the hosts are checked and
    ranked once, so trying many plans costs a walk down a sorted list, not a score of
    every node per evicted pod (at 5,000 nodes that was seconds per pending pod)."""

    def __init__(
        self,
        states: Mapping[str, NodeState | None],
        fresh: Mapping[str, bool],
        facts: Mapping[str, NodeFacts],
        policy: Policy,
    ) -> None:
        self.states, self.fresh, self.facts, self.policy = states, fresh, facts, policy
        self._ranked: dict[tuple[Any, ...], list[tuple[float, str]]] = {}

    def _hosts(self, pod: PodFacts, n: str, st: NodeState | None) -> bool:
        return (
            st is not None
            and check_node(st, pod.shape, fresh=self.fresh.get(n, False)) is None
            and st.can_host(pod.shape)
            and may_land(pod, self.facts.get(n))
        )

    def ranked(self, pod: PodFacts) -> list[tuple[float, str]]:
        """(-score, node) of every node that can take `pod` now, best first (ties by
        name: the order the extender's own choice would take)."""
        sig = (pod.shape, tuple(sorted(pod.node_selector.items())), repr(pod.tolerations))
        out = self._ranked.get(sig)
        if out is None:
            out = sorted(
                (-self.policy.raw_score(st, pod.shape), n)
                for n, st in self.states.items()
                if st is not None and self._hosts(pod, n, st)
            )
            self._ranked[sig] = out
        return out

    def fits_now(self, pod: PodFacts) -> bool:
        return bool(self.ranked(pod))

    def elsewhere(self, victims: Sequence[PodFacts], source: str) -> list[str] | None:
        """Where each victim would go now (by the policy, one after the other), or
        None if one fits nowhere but the node it leaves. Nodes a victim was placed on
        are scored again as they now are; the others keep their rank."""
        changed: dict[str, NodeState] = {}
        targets = []
        for v in victims:
            best: tuple[float, str] | None = None
            for entry in self.ranked(v):
                if entry[1] != source and entry[1] not in changed:
                    best = entry  # the best node nobody has been placed on yet
                    break
            for n, st in changed.items():
                if self._hosts(v, n, st):
                    cand = (-self.policy.raw_score(st, v.shape), n)
                    if best is None or cand < best:
                        best = cand
            if best is None:
                return None
            chosen = best[1]
            base = changed.get(chosen) or self.states[chosen]
            assert base is not None
            changed[chosen] = base.with_placed(v.shape)
            targets.append(chosen)
        return targets


def defragment(
    pending: PodFacts,
    states: Mapping[str, NodeState | None],
    fresh: Mapping[str, bool],
    facts: Mapping[str, NodeFacts],
    running: Mapping[str, Sequence[PodFacts]],
    policy: Policy,
    placer: Placer | None = None,
) -> Plan | None:
    """The cheapest plan that makes room for `pending`, or None. Whole GPUs only.
    `placer`: one per pass, shared by the pending pods of that pass."""
    if pending.shape.gpus <= 0 or pending.shape.mig or pending.other_affinity:
        return None
    if pending.gang or not pending.unschedulable:
        return None  # a gang needs room for all its pods; an untried pod may fit yet
    placer = placer or Placer(states, fresh, facts, policy)
    if placer.fits_now(pending):
        return None  # the scheduler will place it; nothing to move
    # Each node's victims do not depend on where they go: rank the nodes by what their
    # plan would cost, then the first whose victims all fit elsewhere is the cheapest.
    candidates: list[tuple[tuple[int, int, str], tuple[PodFacts, ...]]] = []
    for node, st in states.items():
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
        cost = (len(victims), sum(v.shape.gpus for v in victims), node)
        candidates.append((cost, tuple(victims)))
    for (_, _, node), victims_t in sorted(candidates, key=lambda c: c[0]):
        targets = placer.elsewhere(victims_t, node)
        if targets is not None:
            return Plan(pending, node, victims_t, tuple(targets))
    return None
