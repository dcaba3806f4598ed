"""What the rebalancer would evict, and why: pure functions of the cluster as the
extender sees it (its `NodeState`s, free-GPU count and policies) and of the pods.

- **drain**: pods holding a GPU whose verdict's action needs it (`drain`, `reset_gpu`,
  `reboot_node`: every GPU pod of the node, `replace`; an older agent's unhealthy GPU:
  `drain`), once it has been so for the grace period, on nodes whose agent data is
  fresh; never for `watch` (a degraded GPU);
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

from gpudaemon.cluster.podspec import pod_gang, pod_shape
from gpudaemon.cluster.policies.base import Policy
from gpudaemon.cluster.scoring import check_node
from gpudaemon.cluster.selectors import unschedulable_since
from gpudaemon.cluster.state import NodeState, PodShape
from gpudaemon.labels.annotations import GpuState
from gpudaemon.rebalancer.fits import (
    NodeFit,
    PodFit,
    excluded_domains,
    in_domains,
    insufficient,
    node_fit,
    pod_fit,
    static_reason,
    used_by,
)

OPT_IN_ANNOTATION = "gpudaemon.io/rebalance"


NodeFacts = NodeFit  # what placement needs beyond NodeState: labels, taints, allocatable


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
    # Everything kube-scheduler's filters read (`fits`): requests, selectors, affinity,
    # tolerations, and what cannot be judged from the caches.
    fit: PodFit = field(default_factory=PodFit)
    terminating: bool = False  # deleted (or evicted) already: its GPUs free up soon
    # Pending only: the scheduler tried it and found no node (PodScheduled=False).
    unschedulable: bool = False
    gang: str = ""  # "ns/podgroup" (scheduling.x-k8s.io/pod-group), "" when none
    scheduler: str = ""  # spec.schedulerName

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def cannot_judge(self) -> str:
        """Why the scheduler's verdict on this pod cannot be foreseen ("" if it can):
        such a pod is never moved, and never made room for."""
        return self.fit.unjudgeable


def pod_facts(
    obj: Mapping[str, Any], product_label: str, selector: Callable[[Mapping[str, str]], bool]
) -> PodFacts | None:
    """The pod's facts, or None when its resources cannot be read."""
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    try:
        shape = pod_shape(obj, product_label)
        fit = pod_fit(obj)
    except (ValueError, AttributeError, TypeError):
        return None
    if fit.node_name:  # bound: what matters is where its replacement may go
        fit = replace(fit, node_name="")
    labels = meta.get("labels") or {}
    ann = meta.get("annotations") or {}
    owners = meta.get("ownerReferences") or []
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
        fit=fit,
        terminating=bool(meta.get("deletionTimestamp")),
        unschedulable=unschedulable_since(obj) is not None,
        gang=pod_gang(obj),
        scheduler=str(spec.get("schedulerName") or ""),
    )


def node_facts(obj: Mapping[str, Any]) -> NodeFacts:
    return node_fit(obj)


def may_land(pod: PodFacts, facts: NodeFacts | None) -> bool:
    """nodeName, cordon, nodeSelector, required node affinity and taints allow the pod
    on the node, whatever it frees (GPU product and counts: NodeState)."""
    return facts is not None and static_reason(pod.fit, facts) == ""


# -- drain ----------------------------------------------------------------------------

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

    @staticmethod
    def of(node: str, g: GpuState, for_s: float) -> SickGpu:
        return SickGpu(node, g.index, drain_action(g), g.reason or g.state, for_s, g.pods)


@dataclass(frozen=True)
class Decision:
    """One pod the rebalancer would evict, or will not: `reason` is a metric label."""

    pod: PodFacts
    kind: str  # "drain" | "defrag"
    reason: str  # evict: "unhealthy_gpu", "make_room"; skip: "bare_pod", "stale", ...
    message: str
    evict: bool
    action: str = ""  # drain: the GPU's action (a metric label); "" for defrag


def drain(
    sick: Iterable[SickGpu],
    pods: Mapping[str, PodFacts],
    fresh: Mapping[str, bool],
    grace_s: float,
) -> list[Decision]:
    """`sick`: every GPU whose action needs a drain (`SickGpu.of`). Its holders go, and
    for `reboot_node` every pod of the node that asks for GPUs (the reboot takes them
    all, and the agent's holders may not list each). Pods on stale nodes and before the
    grace period are left; a pod is judged once, for the first GPU that names it."""
    out: list[Decision] = []
    seen: set[str] = set()
    by_node: dict[str, list[str]] | None = None
    for gpu in sick:
        node, action = gpu.node, gpu.action
        holders: Iterable[str] = gpu.holders
        if action == "reboot_node":
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
            if action == "reboot_node":
                what += ": every GPU pod of the node goes"
            if not fresh.get(node, False):
                msg = f"{what}, but the agent data is stale"
                out.append(Decision(pod, "drain", "stale", msg, False, action))
            elif gpu.for_s < grace_s:
                continue  # not yet: no event for every pass of the grace period
            elif not pod.owned:
                msg = f"{what}; not evicted: a bare pod (no controller would re-create it)"
                out.append(Decision(pod, "drain", "bare_pod", msg, False, action))
            else:
                msg = (f"{what}, for {gpu.for_s:.0f} s; evicting so its controller re-creates it"
                       " elsewhere")  # fmt: skip
                out.append(Decision(pod, "drain", "unhealthy_gpu", msg, True, action))
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


@dataclass(frozen=True)
class Refusal:
    """Why no room is made for a pending pod at all: `reason` is a metric label."""

    reason: str  # "cannot_judge" | "never_fits"
    message: str


def repellers(
    facts: Mapping[str, NodeFacts], running: Mapping[str, Sequence[PodFacts]]
) -> list[tuple[PodFit, NodeFacts]]:
    """Running pods with required anti-affinity, and their nodes: they keep the pods
    they select out of their topology domain."""
    return [
        (p.fit, f)
        for n, pods in running.items()
        if (f := facts.get(n)) is not None
        for p in pods
        if p.fit.anti_affinity and not p.terminating
    ]


class Placer:
    """Where pods would land now, by the extender's policy, for one pass: for each
    placement signature (shape and what the scheduler's filters read) the hosts are
    checked and ranked once, so trying many plans costs a walk down a sorted list, not
    a score of every node per evicted pod (at 5,000 nodes that was seconds per pending
    pod). A host passes the extender's GPU check and every filter `fits` can judge:
    resources against what the node's pods request, selectors, affinity, taints, and
    other pods' required anti-affinity."""

    def __init__(
        self,
        states: Mapping[str, NodeState | None],
        fresh: Mapping[str, bool],
        facts: Mapping[str, NodeFacts],
        policy: Policy,
        running: Mapping[str, Sequence[PodFacts]] | None = None,
    ) -> None:
        self.states, self.fresh, self.facts, self.policy = states, fresh, facts, policy
        self.running = running or {}
        self._used: dict[str, dict[str, int]] = {}
        self.repellers = repellers(facts, self.running)
        self._ranked: dict[tuple[Any, ...], list[tuple[float, str]]] = {}
        self._refusals: dict[tuple[Any, ...], Refusal | None] = {}

    def used(self, node: str) -> dict[str, int]:
        """What the pods on `node` request (computed when first needed: most nodes
        fail the GPU check before their pods matter)."""
        got = self._used.get(node)
        if got is None:
            got = self._used[node] = used_by(p.fit for p in self.running.get(node, ()))
        return got

    def excluded(self, pod: PodFacts) -> set[tuple[str, str]]:
        return excluded_domains(pod.fit, self.repellers) if self.repellers else set()

    def _hosts(
        self, pod: PodFacts, n: str, st: NodeState | None, excluded: set[tuple[str, str]],
        added: Mapping[str, int] | None = None,
    ) -> bool:  # fmt: skip
        if st is None or check_node(st, pod.shape, fresh=self.fresh.get(n, False)) is not None:
            return False
        f = self.facts.get(n)
        if not st.can_host(pod.shape) or f is None or not may_land(pod, f):
            return False
        if in_domains(f, excluded):
            return False
        used = self.used(n)
        if added:
            used = {r: used.get(r, 0) + added.get(r, 0) for r in {*used, *added}}
        return not insufficient(pod.fit.requests, f.allocatable, used)

    def ranked(self, pod: PodFacts) -> list[tuple[float, str]]:
        """(-score, node) of every node that can take `pod` now, best first (ties by
        name: the order the extender's own choice would take)."""
        labels = (pod.fit.namespace, tuple(sorted(pod.fit.labels.items())))
        sig = (pod.shape, pod.fit.signature, labels if self.repellers else None)
        out = self._ranked.get(sig)
        if out is None:
            excluded = self.excluded(pod)
            out = sorted(
                (-self.policy.raw_score(st, pod.shape), n)
                for n, st in self.states.items()
                if st is not None and self._hosts(pod, n, st, excluded)
            )
            self._ranked[sig] = out
        return out

    def fits_now(self, pod: PodFacts) -> bool:
        return bool(self.ranked(pod))

    def refusal(self, pending: PodFacts) -> Refusal | None:
        """A pending pod the scheduler would not place on any node even if every pod
        were evicted from it (it needs a resource, label or toleration no node has), or
        one whose verdict cannot be foreseen: evicting for it would only disrupt. None:
        look for room. Judged once per kind of pod in a pass."""
        if pending.cannot_judge:
            return Refusal("cannot_judge", "cannot tell whether the scheduler would place "
                           f"it: {pending.cannot_judge}")  # fmt: skip
        labels = (pending.fit.namespace, tuple(sorted(pending.fit.labels.items())))
        sig = (pending.shape, pending.fit.signature, labels if self.repellers else None)
        if sig not in self._refusals:
            self._refusals[sig] = self._never_fits(pending)
        return self._refusals[sig]

    def _never_fits(self, pending: PodFacts) -> Refusal | None:
        excluded = self.excluded(pending)
        why: dict[str, int] = {}
        for n, f in self.facts.items():
            reason = static_reason(pending.fit, f)
            if not reason and in_domains(f, excluded):
                reason = "a pod there has required anti-affinity against it"
            if not reason:
                short = insufficient(pending.fit.requests, f.allocatable, {})
                reason = f"not enough {', '.join(short)} even when empty" if short else ""
            if not reason and pending.shape.wants_gpus:
                st = self.states.get(n)
                if st is None or st.gpus_allocatable < pending.shape.gpus:
                    reason = "too few GPUs even when empty"
                elif not pending.shape.fits_model(st.gpu_model):
                    reason = "another GPU product"
            if not reason:
                return None
            why[reason] = why.get(reason, 0) + 1
        top = sorted(why.items(), key=lambda kv: (-kv[1], kv[0]))[:3]
        detail = "; ".join(f"{c} node{'s' if c != 1 else ''}: {r}" for r, c in top)
        return Refusal("never_fits", "no node could run it even with every pod evicted "
                       f"({detail or 'no nodes'})")  # fmt: skip

    def elsewhere(self, victims: Sequence[PodFacts], source: str) -> list[str] | None:
        """Where each victim would go now (by the policy, one after the other), or
        None if one fits nowhere but the node it leaves. Nodes a victim was placed on
        are scored again as they now are; the others keep their rank."""
        changed: dict[str, NodeState] = {}
        added: dict[str, dict[str, int]] = {}
        targets = []
        for v in victims:
            best: tuple[float, str] | None = None
            for entry in self.ranked(v):
                if entry[1] != source and entry[1] not in changed:
                    best = entry  # the best node nobody has been placed on yet
                    break
            excluded = self.excluded(v) if changed else set()
            for n, st in changed.items():
                if self._hosts(v, n, st, excluded, added[n]):
                    cand = (-self.policy.raw_score(st, v.shape), n)
                    if best is None or cand < best:
                        best = cand
            if best is None:
                return None
            chosen = best[1]
            base = changed.get(chosen) or self.states[chosen]
            assert base is not None
            changed[chosen] = base.with_placed(v.shape)
            extra = added.setdefault(chosen, {})
            for r, q in v.fit.requests.items():
                extra[r] = extra.get(r, 0) + q
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
    if pending.shape.gpus <= 0 or pending.shape.mig or pending.cannot_judge:
        return None
    if pending.gang or not pending.unschedulable:
        return None  # a gang needs room for all its pods; an untried pod may fit yet
    placer = placer or Placer(states, fresh, facts, policy, running)
    if placer.fits_now(pending):
        return None  # the scheduler will place it; nothing to move
    excluded = placer.excluded(pending)
    # Each node's victims do not depend on where they go: rank the nodes by what their
    # plan would cost, then the first whose victims all fit elsewhere is the cheapest.
    candidates: list[tuple[tuple[int, int, str], tuple[PodFacts, ...]]] = []
    for node, st in states.items():
        f = facts.get(node)
        if st is None or not fresh.get(node, False) or not may_land(pending, f):
            continue
        assert f is not None
        if in_domains(f, excluded):
            continue
        why = check_node(st, PodShape(0), fresh=True)
        if why is not None or st.gpus_allocatable - st.gpus_unhealthy < pending.shape.gpus:
            continue  # no agent, stale or sick, or too small even when empty
        need = pending.shape.gpus - st.gpus_free
        movable = sorted(
            (
                p
                for p in running.get(node, ())
                if p.opted_in and p.owned and not p.cannot_judge and not p.terminating
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
        left = dict(placer.used(node))
        for r, q in used_by(v.fit for v in victims_t).items():
            left[r] = left.get(r, 0) - q
        if insufficient(pending.fit.requests, facts[node].allocatable, left):
            continue  # another resource (a device, storage, the pod count) stays short
        targets = placer.elsewhere(victims_t, node)
        if targets is not None:
            return Plan(pending, node, victims_t, tuple(targets))
    return None
