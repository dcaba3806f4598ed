"""The extender's decisions, named as kube-scheduler names its steps, each made of the
plug-ins `extender.plugins` enables (cluster/plugins/). Per request the framework
writes what it knows of the pod into a fresh `CycleState`, then runs **PreFilter**
(every enabled plug-in's `pre_filter`, once), **filter** (which nodes can take the
pod: the filter plug-ins in order; then the best few by score), **score** (the tier
plug-ins compared in order, then the score plug-ins' normalised scores summed with
their weights, ranked onto 0-10) and **reserve** (the reserve plug-ins, for the node
ranked first, or for the one node `filter` passes: the scheduler then skips
/prioritize).

Each request works on one snapshot of the cluster, taken under the cluster's lock, and
the decisions are serialised under one lock: a pod's ranking and the reservation it
leaves behind are one step, so concurrent requests (two scheduler replicas, or
retries) never score from a count another request is about to change. The wire format
(api.py) only decodes, calls these and encodes.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpudaemon.cluster.clusterstate import ClusterState, Snapshot
from gpudaemon.cluster.plugins import (
    POD,
    Cycle,
    CycleState,
    NodeFilter,
    RealPod,
    build_profile,
    tiered,
    weighted_sum,
)
from gpudaemon.cluster.podspec import pod_gang, pod_policy, pod_shape
from gpudaemon.cluster.policies import Policy, UnknownPodPolicy, UnknownPolicyError, choose_policy
from gpudaemon.cluster.reservations import LeaseReservations
from gpudaemon.cluster.scoring import MAX_SCORE, Rejection, ScoreMemo, Scorer, best_nodes, rank
from gpudaemon.cluster.state import NodeState, PodShape
from gpudaemon.config import PluginsConfig
from gpudaemon.extender.gpuless import FullNodesFirst
from gpudaemon.extender.metrics import ExtenderMetrics
from gpudaemon.extender.pods import PodVerifier
from gpudaemon.extender.verdicts import VerdictTable, VerdictTables
from gpudaemon.httpserver import Readiness

# Requests naming at least this many nodes are answered from the verdict tables
# (verdicts.py); smaller ones cost less judged afresh than the tables cost to keep.
TABLE_MIN_NODES = 64


class BadPod(ValueError):
    """The pod in the request cannot be read (its resources): a 400 with this reason."""


class NotReady(RuntimeError):
    """The caches have not listed yet: answered 503, so the scheduler retries soon.
    Empty caches would judge every node "no agent data" and the scheduler would park
    the pod as unschedulable."""


@dataclass
class FilterResult:
    passed: list[str]
    failed: dict[str, str] = field(default_factory=dict)


class Framework:
    def __init__(
        self,
        cluster: ClusterState,
        policies: Mapping[str, Policy],
        default_policy: str,
        metrics: ExtenderMetrics,
        ready: Readiness,
        *,
        avoid_unhealthy: bool = True,
        prefer_healthy_gpus: bool = True,
        gpuless_pods: str = "full_nodes_first",
        candidates: int = 0,
        observe: Callable[[str, PodShape], None] | None = None,
        verifier: PodVerifier | None = None,
        reservations: LeaseReservations | None = None,
        plugins: PluginsConfig | None = None,
    ) -> None:
        if default_policy not in policies:
            raise UnknownPolicyError(default_policy)
        self.cluster = cluster
        self.policies = dict(policies)
        self.default_policy = default_policy
        self.metrics = metrics
        self.ready = ready
        self.avoid_unhealthy = avoid_unhealthy
        self.prefer_healthy_gpus = prefer_healthy_gpus
        self.gpuless_pods = gpuless_pods  # extender.gpuless_pods
        self._gpuless = FullNodesFirst(cluster)
        self.candidates = candidates
        self.observe = observe
        # None trusts the body's pod (in-process tests and benchmarks only): the
        # `gpudaemon extender` program always verifies (see pods.py).
        self.verifier = verifier
        # The pending pods, by gang: how much of a gang is still to place.
        self.pending = verifier.pending if verifier is not None else None
        # The rebalancer's reservations, from its Lease only (reservations.py); honoured
        # only for pods the pending cache shows unbound, so only with a verifier.
        self.reservations = reservations if self.pending is not None else None
        self._lock = threading.Lock()
        # The plug-ins, built with this framework as their handle (plugins/base.py).
        self.profile = build_profile(plugins or PluginsConfig(), self)
        self._scores = ScoreMemo(max_shapes=16 * len(self.profile.scores))  # under _lock
        self._tables = VerdictTables(_reason, max_tables=16)  # under _lock
        self.table_min_nodes = TABLE_MIN_NODES
        for p in self.policies.values():  # what they learn from nodes, off the request path
            cluster.add_node_listener(p)

    # -- the pod ------------------------------------------------------------------

    def shape(self, pod: Mapping[str, Any]) -> PodShape:
        try:
            return self.cluster.with_dra(pod, pod_shape(pod, self.cluster.product_label))
        except ValueError as e:
            raise BadPod(f"pod resources: {e}") from None
        except (AttributeError, TypeError):
            raise BadPod("pod spec is malformed (containers/resources)") from None

    def policy_for(self, pod: Mapping[str, Any], shape: PodShape | None = None) -> Policy:
        """The pod's policy (annotation), else MIG packing for a pod of MIG devices
        alone, else the default (cluster/policies/choice.py, the rule the rebalancer
        follows too). An unknown name is an error the scheduler shows the user
        (`UnknownPodPolicy`), not a silent fallback."""
        default = self.policies[self.default_policy]
        return choose_policy(pod_policy(pod), shape, self.policies, default)

    def _real_pod(self, pod: Mapping[str, Any], shape: PodShape) -> RealPod | None:
        """(UID, requests, gang) of the real pod behind the body, or None: then nothing
        is reserved or learned for it, and the reason is counted."""
        if self.verifier is None:  # trusted (tests, benchmarks); "" is never reserved
            return RealPod(_uid(pod), shape, pod_gang(pod))
        real, why = self.verifier.verify(pod)
        if real is None:
            self.metrics.unverified.labels(why).inc()
            return None
        return RealPod(real.uid, self.cluster.with_claims(real.claims, real.shape), real.gang)

    def _cycle(
        self, pod: Mapping[str, Any], shape: PodShape, policy: Policy, real: RealPod | None
    ) -> CycleState:
        """The request's cycle state, with what the framework knows of the pod."""
        state = CycleState()
        uid = real.uid if real is not None else _uid(pod)
        state.write(POD, Cycle(pod, shape, policy, uid, self.cluster.wall(), real))
        return state

    def _pre_filter(self, state: CycleState) -> None:
        """PreFilter: each enabled plug-in's, once per request (under `_lock`, so what
        they read of the cluster is what the request decides on)."""
        for p in self.profile.pre_filters:
            p.pre_filter(state)

    def _scored(
        self, state: CycleState, names: Sequence[str], states: Mapping[str, NodeState | None]
    ) -> dict[str, float]:
        """The pod's score per node: each score plug-in's raw scores (memoized), summed
        with the weights over these nodes (plugins/combine.py `weighted_sum`)."""
        memo, shape = self._scores, state.read(POD).shape
        return weighted_sum(
            [(memo.scores(s, shape, names, states), w) for s, w in self._scorers(state)]
        )

    def _scorers(self, state: CycleState) -> list[tuple[Scorer, int]]:
        """The score plug-ins with a say on this pod, and their weights. None for a pod
        asking for no GPU unless `gpuless_pods: policy`: `score` ranks it by the GPUs
        its node has free, or not at all (issue 40)."""
        if not (state.read(POD).shape.wants_gpus or self.gpuless_pods == "policy"):
            return []
        return [(s, w) for p, w in self.profile.scores if (s := p.scorer(state)) is not None]

    def _ranked(
        self, state: CycleState, raw: dict[str, float], snap: Snapshot
    ) -> Mapping[str, Any]:
        """What the nodes are ranked by: the tiers in front of the summed scores
        (plugins/combine.py `tiered`)."""
        return tiered(self.profile.tiers, state, raw, snap)

    def _require_ready(self) -> None:
        ready, why = self.ready()
        if not ready:
            raise NotReady(why)

    # -- filter -------------------------------------------------------------------

    def filter(self, pod: Mapping[str, Any], names: Sequence[str]) -> FilterResult:
        shape = self.shape(pod)
        if not shape.wants_gpus:  # not ours to judge: pass everything through, quickly
            return FilterResult(list(names))
        self._require_ready()
        try:
            policy = self.policy_for(pod, shape)
        except UnknownPodPolicy as e:
            self.metrics.filter_nodes.labels("unknown_policy").inc(len(names))
            return FilterResult([], {n: str(e) for n in names})
        real = self._real_pod(pod, shape)
        if real is not None:
            # Filtered again: its last placement did not happen (a gang timed out at
            # Permit, a bind failed), so it no longer holds the GPUs it was assumed on.
            self.cluster.unassume(real[0])
            for p in self.policies.values():
                p.observe_pod(real[0], real[1])
            if self.observe is not None:
                self.observe(real[0], real[1])
        state = self._cycle(pod, shape, policy, real)
        uid = state.read(POD).uid
        rejected: dict[str, Rejection] = {}
        with self._lock:
            self._pre_filter(state)
            prepared = [(f, c) for f in self.profile.filters if (c := f.filter(state)) is not None]
            filters = [c for _, c in prepared]
            fast = self._table(state, names, prepared)
            if fast is not None:
                return self._filter_from(state, fast[0], fast[1], names)
            snap = self.cluster.snapshot(names, uid, real.shape if real is not None else shape)
            states, fresh = snap.states, snap.fresh
            passed = list(names)
            for run in filters:  # in order, each on what the ones before passed
                passed = run(passed, states, fresh, rejected)
            removed: Counter[str] = Counter(r.reason for r in rejected.values())
            if 0 < self.candidates < len(passed):
                # Narrow to the best nodes by score. Those outranked are not listed in
                # FailedNodes: the scheduler reads that map only for a pod that fits
                # nowhere, and here some node fits; listing them would cost the
                # scheduler a map of every node to decode per pod.
                raw = self._scored(state, passed, states) if self._scorers(state) else {}
                if raw:  # none scorable (our CPU/memory view says no node fits, the
                    # scheduler's says some do): leave the choice to the scheduler
                    keep = best_nodes(self._ranked(state, raw, snap), self.candidates)
                    if len(keep) < self.candidates:  # fill up with the unscored ones
                        keep += [n for n in passed if n not in raw][: self.candidates - len(keep)]
                    removed["outranked"] += len(passed) - len(keep)
                    passed = keep
            if (
                real is not None
                and len(passed) == 1
                and (s := states[passed[0]]) is not None
                and s.can_host(real.shape)
            ):
                # The scheduler skips /prioritize with one feasible node, so the pod
                # would never be reserved: reserve it here, or the next pods of a burst
                # are judged from a count that misses it.
                self._reserve(state, passed[0])
        for reason, count in removed.items():
            self.metrics.filter_nodes.labels(reason).inc(count)
        self.metrics.filter_nodes.labels("passed").inc(len(passed))
        return FilterResult(passed, {n: _reason(r) for n, r in rejected.items()})

    def _table(
        self,
        state: CycleState,
        names: Sequence[str],
        prepared: Sequence[tuple[object, NodeFilter]],
    ) -> tuple[VerdictTable, set[str]] | None:
        """The pod's verdict table, brought up to date, when its answer is the general
        path's from the table alone: a large request naming each node once, filters that
        judge only the node's state and freshness (`pure`), one score plug-in, no DRA
        claim, and no tier with a say (a gang pod; a free degraded GPU): those rank per
        pod. Under `_lock`."""
        if len(names) < self.table_min_nodes:
            return None
        if not all(getattr(f, "pure", False) for f, _ in prepared):
            return None
        cycle = state.read(POD)
        real = cycle.real
        if cycle.shape.dra or (real is not None and real.shape.dra):
            return None
        tiers = self.profile.tiers
        if any(t.has_say(state, False) for t in tiers):
            return None
        scorers = self._scorers(state)
        if len(scorers) > 1:
            return None
        key = tuple(str(getattr(f, "name", "")) for f, _ in prepared)
        table = self._tables.get(scorers[0][0] if scorers else None, cycle.shape, key)
        nameset = table.named(names if isinstance(names, list) else list(names))
        if nameset is None:
            return None
        no_degraded = table.update(
            self.cluster, [c for _, c in prepared], nameset, self.cluster.wall()
        )
        if not no_degraded and any(t.has_say(state, True) for t in tiers):
            return None
        return table, nameset

    def _filter_from(
        self, state: CycleState, table: VerdictTable, nameset: set[str], names: Sequence[str]
    ) -> FilterResult:
        """`filter`'s answer from the pod's verdict table (under `_lock`)."""
        got = table.filter(list(names), nameset, self.candidates)
        passed = got.passed
        real = state.read(POD).real
        if (
            real is not None
            and len(passed) == 1
            and (s := got.states[passed[0]]) is not None
            and s.can_host(real.shape)
        ):  # as in `filter`: the scheduler skips /prioritize with one feasible node
            self._reserve(state, passed[0])
        removed = got.reasons
        if got.outranked is not None:
            removed["outranked"] += got.outranked
        for reason, count in removed.items():
            self.metrics.filter_nodes.labels(reason).inc(count)
        self.metrics.filter_nodes.labels("passed").inc(len(passed))
        return FilterResult(passed, got.failed)

    # -- score --------------------------------------------------------------------

    def score(self, pod: Mapping[str, Any], names: Sequence[str]) -> list[tuple[str, int]]:
        """0..10 per node, in the request's order; the pick alone at 10 (scoring.rank),
        and the pod reserved on it."""
        shape = self.shape(pod)
        try:
            policy = self.policy_for(pod, shape)
        except UnknownPodPolicy:  # filter already failed every node with the reason
            return [(n, 0) for n in names]
        state = CycleState()
        state.write(POD, Cycle(pod, shape, policy, "", 0.0))
        if not self._scorers(state):  # no plug-in has a say on this pod
            if not shape.wants_gpus and self.gpuless_pods == "full_nodes_first":
                return self._gpuless.scores(names)
            return [(n, 0) for n in names]  # neutral: kube-scheduler draws at random
        self._require_ready()
        real = self._real_pod(pod, shape)
        state = self._cycle(pod, shape, policy, real)
        with self._lock:
            self._pre_filter(state)
            pure = [(f, c) for f in self.profile.filters if getattr(f, "pure", False)
                    if (c := f.filter(state)) is not None]  # fmt: skip
            fast = self._table(state, names, pure)
            if fast is not None:
                top, scores = fast[0].score(list(names), fast[1])
                if top is not None and real is not None:
                    self._reserve(state, top)
                return list(zip(names, scores, strict=True))
            snap = self.cluster.snapshot(
                names, state.read(POD).uid, real.shape if real is not None else shape
            )
            ranked = self._ranked(state, self._scored(state, names, snap.states), snap)
            top, level = rank(ranked)
            if top is not None and real is not None:
                self._reserve(state, top)
        get = ranked.get
        return [(n, MAX_SCORE if n == top else level.get(get(n), 0)) for n in names]

    # -- reserve ------------------------------------------------------------------

    def _reserve(self, state: CycleState, node: str) -> None:
        """Reserve: the reserve plug-ins, for the pod placed on `node` (assume: count it
        there until the watch shows its binding). Only a real pod with a UID."""
        real = state.read(POD).real
        if real is not None and real.uid and self.profile.reserves:
            for p in self.profile.reserves:
                p.reserve(state, node)
            self.metrics.assumed.inc()


def _uid(pod: Mapping[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    uid = meta.get("uid") if isinstance(meta, dict) else None
    return uid if isinstance(uid, str) else ""


def _reason(r: Rejection) -> str:
    return f"gpudaemon: {r.message}"
