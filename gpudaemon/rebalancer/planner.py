"""What the rebalancer would evict, and why: pure functions of the cluster as the
extender sees it (its `NodeState`s, free-GPU count and policies) and of the pods.

- **drain** (`drain.py`): pods holding a GPU whose verdict's action needs it (`drain`, `reset_gpu`,
  `reboot_node`: every GPU pod of the node, `replace`; an older agent's unhealthy GPU:
  `drain`), once it has been so for the grace period, on nodes whose agent data is
  fresh; never for `watch` (a degraded GPU);
- **defragment**: for a pending GPU pod that fits on no node, the fewest evictions on
  one node that make it fit, where every evicted pod fits on another node now (placed
  by the extender's own plug-in profile, `extender.plugins`, one after the other, each
  scored by its own policy and kept out of the room the rebalancer keeps for another
  pending pod). All or nothing, as KAI-Scheduler's Consolidate: a plan that does not
  hold is not started.

Nothing here calls the API; `app.py` acts on the plans.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from gpudaemon.cluster.checks import Rejection
from gpudaemon.cluster.clusterstate import ClusterState, Snapshot
from gpudaemon.cluster.plugins import (
    BY_POD,
    POD,
    Cycle,
    CycleState,
    NodeFilter,
    PendingView,
    Profile,
    build_profile,
    per_node,
    tiered,
    weighted_sum,
)
from gpudaemon.cluster.podspec import pod_gang, pod_policy, pod_shape
from gpudaemon.cluster.policies import Policy, UnknownPodPolicy, choose_policy
from gpudaemon.cluster.reservations import KeptRooms
from gpudaemon.cluster.scoring import ScoreMemo, Scorer
from gpudaemon.cluster.selectors import unschedulable_since
from gpudaemon.cluster.state import NodeState, PodShape
from gpudaemon.config import PluginsConfig
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
    # "ns/podgroup" (spec.schedulingGroup or scheduling.x-k8s.io/pod-group), "" if none
    gang: str = ""
    scheduler: str = ""  # spec.schedulerName
    # Its gpudaemon.io/policy annotation, cut as podspec.pod_policy cuts it (None: none):
    # it is scored by that policy wherever the extender places it.
    policy: str | None = None

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
        policy=pod_policy(obj),
    )


def node_facts(obj: Mapping[str, Any]) -> NodeFacts:
    return node_fit(obj)


def may_land(pod: PodFacts, facts: NodeFacts | None) -> bool:
    """nodeName, cordon, nodeSelector, required node affinity and taints allow the pod
    on the node, whatever it frees (GPU product and counts: NodeState)."""
    return facts is not None and static_reason(pod.fit, facts) == ""


@dataclass(frozen=True)
class Decision:
    """One pod the rebalancer would evict, or will not: `reason` is a metric label."""

    pod: PodFacts
    kind: str  # "drain" | "defrag"
    reason: str  # evict: "unhealthy_gpu", "make_room"; skip: "bare_pod", "stale", ...
    message: str
    evict: bool
    action: str = ""  # drain: the GPU's action (a metric label); "" for defrag


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

    reason: str  # "cannot_judge" | "unknown_policy" | "never_fits"
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


@dataclass
class PlacementHandle:
    """The rebalancer's handle for building the extender's plug-in profile
    (cluster/plugins/base.py `Handle`). `pending`: the rebalancer's own pending pods;
    `reservations`: the rooms it keeps itself (state.py `LeaseState`), so `reserved`
    keeps a victim out of the room kept for another pending pod. None (the default,
    for tests and callers without them): `reserved` has no say. `gang` has none either
    way: the rebalancer moves no gang pod and makes room for none."""

    cluster: ClusterState
    policies: dict[str, Policy]
    avoid_unhealthy: bool = True
    prefer_healthy_gpus: bool = True
    pending: PendingView | None = None
    reservations: KeptRooms | None = None


_DEFAULT: list[Profile] = []


def default_profile() -> Profile:
    """The profile of the default `extender.plugins` (fresh, healthy, gpu_fit; the
    pod's policy; free GPUs that are not degraded first), for callers that give none."""
    if not _DEFAULT:
        _DEFAULT.append(build_profile(PluginsConfig(), PlacementHandle(ClusterState(), {})))
    return _DEFAULT[0]


@dataclass(frozen=True)
class _Rules:
    """What the profile makes of one kind of pod: its cycle state, its filters and its
    scorers with their weights. `own`: a node's rank depends on its own state alone (one
    score plug-in and no tier with a say), so a node a victim was placed on is scored
    again alone; otherwise the sum is normalised over the nodes, and they are ranked
    together again. `key`: the kind (requests, policy, and the pod itself when a
    plug-in judges it alone: `BY_POD`)."""

    state: CycleState
    filters: tuple[NodeFilter, ...]
    scorers: tuple[tuple[Scorer, int], ...]
    own: bool
    key: tuple[Any, ...] = ()


class Placer:
    """Where pods would land now, by the extender's configured plug-ins
    (`extender.plugins`: its filters in order, its score plug-ins summed with their
    weights, its tiers compared first; cluster/plugins/), for one pass: for each
    placement signature (shape and what the scheduler's filters read) the hosts are
    checked and ranked once, so trying many plans costs a walk down a sorted list, not
    a score of every node per evicted pod (at 5,000 nodes that was seconds per pending
    pod). A host passes the profile's filters and every filter `fits` can judge:
    resources against what the node's pods request, selectors, affinity, taints, and
    other pods' required anti-affinity. `profile`: None for the default one.

    Each pod is scored by its own policy, by the extender's rule (cluster/policies/
    choice.py): its annotation's, migpack for MIG devices alone, else `policy` (the
    default). `policies`: the registered ones an annotation may name (None: `policy`
    alone). A pod whose annotation names none fits nowhere, as the extender fails every
    node for it. `now`: the wall clock, for the rooms kept (`reserved`)."""

    def __init__(
        self,
        states: Mapping[str, NodeState | None],
        fresh: Mapping[str, bool],
        facts: Mapping[str, NodeFacts],
        policy: Policy,
        running: Mapping[str, Sequence[PodFacts]] | None = None,
        *,
        profile: Profile | None = None,
        degraded: Collection[str] = frozenset(),
        policies: Mapping[str, Policy] | None = None,
        now: float = 0.0,
    ) -> None:
        self.states, self.facts, self.policy = states, facts, policy
        self.policies = dict(policies) if policies is not None else {policy.name: policy}
        self.now = now
        # Every node named (a filter reads fresh[n]).
        self.fresh = {n: fresh.get(n, False) for n in states}
        self.running = running or {}
        self.profile = profile if profile is not None else default_profile()
        self.degraded = frozenset(degraded)  # nodes with a free degraded GPU
        self._used: dict[str, dict[str, int]] = {}
        self.repellers = repellers(facts, self.running)
        self._memo = ScoreMemo(max_shapes=1 << 16)
        self._rules: dict[tuple[Any, ...], _Rules] = {}  # by kind (`_Rules.key`)
        self._pod_rules: dict[tuple[Any, ...], _Rules] = {}  # by pod
        # By signature: the hosts, best first, and what each is ranked by.
        self._ranked: dict[tuple[Any, ...], tuple[list[str], Mapping[str, Any]]] = {}
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

    def policy_error(self, pod: PodFacts) -> str:
        """Why the extender places `pod` nowhere by its policy ("" when it may): its
        annotation names no registered policy. Such a pod is never moved, and never
        made room for."""
        try:
            choose_policy(pod.policy, pod.shape, self.policies, self.policy)
        except UnknownPodPolicy as e:
            return str(e).removeprefix("gpudaemon: ")
        return ""

    def rules(self, pod: PodFacts) -> _Rules:
        """The profile's filters, scorers and tiers for this pod: one set per kind of
        pod (its requests, its policy, and what else a PreFilter judges it by: `BY_POD`,
        its priority and whether a room kept is its own)."""
        ident = (pod.uid, pod.key, pod.shape, pod.policy, pod.priority)
        got = self._pod_rules.get(ident)
        if got is None:
            got = self._pod_rules[ident] = self._rules_of(pod)
        return got

    def _rules_of(self, pod: PodFacts) -> _Rules:
        try:
            policy = choose_policy(pod.policy, pod.shape, self.policies, self.policy)
        except UnknownPodPolicy as e:
            # As the extender answers: every node fails, with the reason.
            why = Rejection("unknown_policy", str(e).removeprefix("gpudaemon: "))
            return _Rules(CycleState(), (per_node(lambda st, ok: why),), (), True)
        state = CycleState()
        # What the plug-ins read of the pod (`reserved`: its UID and priority).
        obj = {"metadata": {"uid": pod.uid, "namespace": pod.namespace, "name": pod.name},
               "spec": {"priority": pod.priority}}  # fmt: skip
        state.write(POD, Cycle(obj, pod.shape, policy, pod.uid, self.now))
        for p in self.profile.pre_filters:
            p.pre_filter(state)
        key = (pod.shape, policy.name, state.get(BY_POD))
        got = self._rules.get(key)
        if got is None:
            filters = tuple(c for f in self.profile.filters if (c := f.filter(state)) is not None)
            scorers = tuple(
                (s, w) for p, w in self.profile.scores if (s := p.scorer(state)) is not None
            )
            say = any(t.has_say(state, bool(self.degraded)) for t in self.profile.tiers)
            got = _Rules(state, filters, scorers, len(scorers) <= 1 and not say, key)
            self._rules[key] = got
        return got

    def admits(self, pod: PodFacts, node: str, st: NodeState) -> bool:
        """The profile's filters pass `pod` on `node` as `st` says it is."""
        names, states, fresh = [node], {node: st}, {node: self.fresh.get(node, False)}
        failed: dict[str, Rejection] = {}
        for run in self.rules(pod).filters:
            names = run(names, states, fresh, failed)
        return bool(names)

    def _hosts(
        self, pod: PodFacts, n: str, st: NodeState, excluded: set[tuple[str, str]],
        added: Mapping[str, int] | None = None,
    ) -> bool:  # fmt: skip
        """What kube-scheduler's filters say (`fits`), on a node the profile's pass."""
        f = self.facts.get(n)
        if not st.can_host(pod.shape) or f is None or not may_land(pod, f):
            return False
        if in_domains(f, excluded):
            return False
        used = self.used(n)
        if added:
            used = {r: used.get(r, 0) + added.get(r, 0) for r in {*used, *added}}
        return not insufficient(pod.fit.requests, f.allocatable, used)

    def _order(
        self, rules: _Rules, shape: PodShape, names: list[str],
        states: Mapping[str, NodeState | None],
    ) -> tuple[list[str], Mapping[str, Any]]:  # fmt: skip
        """`names` best first by the profile (ties by name: the order the extender's
        own choice would take), and what each is ranked by. A node no plug-in could
        score (a score that orders nothing) comes last."""
        memo = self._memo
        parts = [(memo.scores(s, shape, names, states), w) for s, w in rules.scorers]
        total = weighted_sum(parts) if parts else dict.fromkeys(names, 0.0)
        snap = Snapshot({n: states.get(n) for n in total}, {}, self.degraded)
        ranked = tiered(self.profile.tiers, rules.state, total, snap)
        order = sorted(ranked)
        order.sort(key=ranked.__getitem__, reverse=True)  # stable: ties stay by name
        order += sorted(n for n in names if n not in ranked)
        return order, ranked

    def _sig(self, pod: PodFacts) -> tuple[Any, ...]:
        labels = (pod.fit.namespace, tuple(sorted(pod.fit.labels.items())))
        rules = self.rules(pod)
        kind = rules.key or (pod.shape, pod.policy)  # () for a policy no one registered
        return (kind, pod.fit.signature, labels if self.repellers else None)

    def _ranking(self, pod: PodFacts) -> tuple[list[str], Mapping[str, Any]]:
        sig = self._sig(pod)
        got = self._ranked.get(sig)
        if got is None:
            rules = self.rules(pod)
            excluded = self.excluded(pod)
            names = [n for n, st in self.states.items() if st is not None]
            failed: dict[str, Rejection] = {}
            for run in rules.filters:  # in order, each on what the ones before passed
                names = run(names, self.states, self.fresh, failed)
            hosts = []
            for n in names:
                st = self.states[n]
                if st is not None and self._hosts(pod, n, st, excluded):
                    hosts.append(n)
            got = self._ranked[sig] = self._order(rules, pod.shape, hosts, self.states)
        return got

    def ranked(self, pod: PodFacts) -> list[str]:
        """Every node that can take `pod` now, best first by the profile."""
        return self._ranking(pod)[0]

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
        if why := self.policy_error(pending):
            return Refusal("unknown_policy", f"the extender places it on no node: {why}")
        sig = self._sig(pending)
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
        """Where each victim would go now (by the profile, one after the other), or
        None if one fits nowhere but the node it leaves. Nodes a victim was placed on
        are judged again as they now are; when each node's rank is its own, the others
        keep theirs, else the nodes are ranked together again."""
        changed: dict[str, NodeState] = {}
        added: dict[str, dict[str, int]] = {}
        targets = []
        for v in victims:
            rules = self.rules(v)
            order, keys = self._ranking(v)
            excluded = self.excluded(v) if changed else set()
            placed = [
                n for n, st in changed.items()
                if self.admits(v, n, st) and self._hosts(v, n, st, excluded, added[n])
            ]  # fmt: skip
            if rules.own:
                chosen = self._best_own(rules, v, order, keys, placed, changed, source)
            else:
                rest = [n for n in order if n != source and n not in changed]
                view = {**self.states, **changed}
                again = self._order(rules, v.shape, rest + placed, view)[0]
                chosen = again[0] if again else None
            if chosen is None:
                return None
            base = changed.get(chosen) or self.states[chosen]
            assert base is not None
            changed[chosen] = _placed(base, v.shape)
            extra = added.setdefault(chosen, {})
            for r, q in v.fit.requests.items():
                extra[r] = extra.get(r, 0) + q
            targets.append(chosen)
        return targets

    def _best_own(
        self, rules: _Rules, v: PodFacts, order: list[str], keys: Mapping[str, Any],
        placed: list[str], changed: Mapping[str, NodeState], source: str,
    ) -> str | None:  # fmt: skip
        """The best node for `v` when each node's rank is its own: the best one nobody
        has been placed on yet, or a node placed on, scored again as it now is."""
        best: tuple[float, str] | None = None
        for n in order:
            if n != source and n not in changed:
                best = (-keys.get(n, -math.inf), n)
                break
        for n in placed:
            cand = (-_own_score(rules, changed[n], v.shape), n)
            if best is None or cand < best:
                best = cand
        return best[1] if best is not None else None


def _placed(st: NodeState, shape: PodShape) -> NodeState:
    """The node after a victim lands on it, counted as bound, not assumed: the
    filters judge what is bound (`gpus_free_bound`), and the next victim must not be
    counted into a room kept for another pod that this one already takes."""
    after = st.with_placed(shape)
    return replace(after, gpus_assumed=st.gpus_assumed, mig_assumed=st.mig_assumed)


def _own_score(rules: _Rules, st: NodeState, shape: PodShape) -> float:
    """A node's score when its rank is its own (`_Rules.own`): the one scorer's raw
    score (one that orders nothing ranks last), 0 with none."""
    if not rules.scorers:
        return 0.0
    raw = rules.scorers[0][0].raw_score(st, shape)
    return raw if math.isfinite(raw) else -math.inf


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
    if placer.policy_error(pending):
        return None  # the extender would place it nowhere, whatever is evicted
    if placer.fits_now(pending):
        return None  # the scheduler will place it; nothing to move
    excluded = placer.excluded(pending)
    # Each node's victims do not depend on where they go: rank the nodes by what their
    # plan would cost, then the first whose victims all fit elsewhere is the cheapest.
    candidates: list[tuple[tuple[int, int, str], tuple[PodFacts, ...], NodeState]] = []
    for node, st in states.items():
        f = facts.get(node)
        if st is None or not fresh.get(node, False) or not may_land(pending, f):
            continue
        assert f is not None
        if in_domains(f, excluded):
            continue
        if st.gpus_allocatable - st.gpus_unhealthy < pending.shape.gpus:
            continue  # too small even when empty
        need = pending.shape.gpus - st.gpus_free
        movable = sorted(
            (
                p
                for p in running.get(node, ())
                if p.opted_in and p.owned and not p.cannot_judge and not p.terminating
                and p.priority <= pending.priority and p.shape.gpus > 0 and not p.shape.mig
                # A gang runs as one unit: evicting one member breaks the whole job.
                and not p.gang
                # The extender places it nowhere: its replacement would stay pending.
                and not placer.policy_error(p)
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
        emptied = _without(st, victims)
        if not emptied.can_host(pending.shape):
            continue  # the GPUs would be free, but not the CPU or memory
        cost = (len(victims), sum(v.shape.gpus for v in victims), node)
        candidates.append((cost, tuple(victims), emptied))
    for (_, _, node), victims_t, emptied in sorted(candidates, key=lambda c: c[0]):
        if not placer.admits(pending, node, emptied):
            continue  # the profile's filters turn it away (no agent, a sick GPU, ...)
        left = dict(placer.used(node))
        for r, q in used_by(v.fit for v in victims_t).items():
            left[r] = left.get(r, 0) - q
        if insufficient(pending.fit.requests, facts[node].allocatable, left):
            continue  # another resource (a device, storage, the pod count) stays short
        targets = placer.elsewhere(victims_t, node)
        if targets is not None:
            return Plan(pending, node, victims_t, tuple(targets))
    return None
