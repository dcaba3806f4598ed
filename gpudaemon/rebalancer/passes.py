"""One pass of the leader, and the acts it decides on: drain the pods of sick GPUs,
then make room for at most one pending pod (`planner` decides; this module counts,
tells and acts through `actions`, inside the rate limit and after the eviction is
written on the Lease).

A pod its room was made for and that stays unschedulable is not made room for again
until ROOM_BACKOFF_S has passed, doubled for each further try, up to the cap; at most
MAX_BACKOFF_PODS pods are remembered (the oldest go first). Kept in memory only: a
restart forgets it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Container, Mapping, Sequence
from typing import Any

from loguru import logger

from gpudaemon.cluster.plugins import Profile
from gpudaemon.cluster.policies.base import Policy
from gpudaemon.cluster.reservations import Reservation
from gpudaemon.config import RebalanceConfig
from gpudaemon.errors import KubeError, KubeNotFoundError
from gpudaemon.kube.leader import LeaderElector
from gpudaemon.labels.annotations import GpuState
from gpudaemon.rebalancer.actions import Actions
from gpudaemon.rebalancer.drain import drain, with_claim_holders
from gpudaemon.rebalancer.metrics import RebalancerMetrics
from gpudaemon.rebalancer.planner import Decision, NodeFacts, Placer, PodFacts, defragment
from gpudaemon.rebalancer.resets import ResetGrants
from gpudaemon.rebalancer.state import LeaseState

# An evicted pod is not evicted again for this long: drain passes can now follow each
# other within a second, before the pod watch shows the pod terminating.
EVICTED_HOLD_S = 60.0
ROOM_BACKOFF_S = 600.0
ROOM_BACKOFF_MAX_S = 6 * 3600.0
MAX_BACKOFF_PODS = 10_000


class Pass:
    """What passes share: the settings, the default policy, the registered ones (a
    pod's annotation may name one) and the extender's plug-in profile (where a pod
    would land: planner.Placer), the series, the rate limit and the Lease state;
    `pending_uids` is read when a reservation is made (the pods still pending then)."""

    def __init__(
        self,
        rb: RebalanceConfig,
        policy: Policy,
        metrics: RebalancerMetrics,
        actions: Actions,
        state: LeaseState,
        elector: LeaderElector,
        pending_uids: Callable[[], Container[str]],
        clock: Callable[[], float],
        profile: Profile | None = None,
        policies: Mapping[str, Policy] | None = None,
    ) -> None:
        self.rb, self.policy, self.metrics, self.actions = rb, policy, metrics, actions
        self.profile = profile  # None: the default `extender.plugins`
        self.policies = policies  # None: `policy` alone
        self.state, self.limits, self.elector = state, state.limits, elector
        self.pending_uids, self.clock = pending_uids, clock
        self.namespaces = frozenset(rb.namespaces)  # empty: every namespace
        self.made_room_for: dict[str, float] = {}  # pending UID -> when its plan ran
        self.room_tries: dict[str, int] = {}  # pending UID -> plans run for it
        # With DRA: (node, GPU UUID) -> UIDs of the pods holding it through a claim.
        self.claim_holders: Callable[[str, str], Sequence[str]] | None = None
        # Pods the last drain and the last defragmentation wanted to evict but could
        # not: a drain-only pass replaces the first and keeps the second for the gauge.
        self.blocked_drain = self.blocked_defrag = 0
        self.evicted_at: dict[str, float] = {}  # pod UID -> when this replica evicted it
        # With remediation.reset_gpu: the reset grants, and the cordoned nodes (set by
        # the caller each pass: a reboot_node drain takes the whole node only then).
        self.resets: ResetGrants | None = None
        self.cordoned: frozenset[str] = frozenset()
        self.reset_grace_s = 0.0

    def run(
        self, nodes: Mapping[str, NodeFacts], gpu_states: Mapping[str, list[GpuState]],
        running: Mapping[str, PodFacts], pending: list[PodFacts], states: Mapping[str, Any],
        fresh: Mapping[str, bool], degraded: Collection[str] = frozenset(),
    ) -> int:  # fmt: skip
        """Drain, then at most one defragmentation plan; the pods it wanted to evict
        but could not. `degraded`: the nodes with a free degraded GPU (a tier reads it)."""
        self.blocked_drain = self._drain(gpu_states, running, fresh)
        self.blocked_defrag = self._defragment(pending, states, fresh, nodes, running, degraded)
        return self.blocked_drain + self.blocked_defrag

    def drain_pass(
        self, gpu_states: Mapping[str, list[GpuState]], running: Mapping[str, PodFacts],
        fresh: Mapping[str, bool],
    ) -> int:  # fmt: skip
        """The drain alone, between regular passes (a GPU newly needs one, or its grace
        ran out): defragmentation waits for the regular pass, so the scheduler settles
        between plans. Returns the blocked pods, the last plan's included."""
        self.blocked_drain = self._drain(gpu_states, running, fresh)
        return self.blocked_drain + self.blocked_defrag

    def commit(self, node: str, count: int) -> bool:
        """Write evictions into the Lease before making them, and make sure we still
        lead: a crash right after them still counts them, and a replica that lost the
        Lease evicts nothing. False: do not evict."""
        for _ in range(count):
            self.limits.record(node)
        if self.elector.checkpoint():
            return True
        for _ in range(count):
            self.limits.forget(node)
        return False

    def _drain(
        self, gpu_states: Mapping[str, list[GpuState]], running: Mapping[str, PodFacts],
        fresh: Mapping[str, bool],
    ) -> int:  # fmt: skip
        sick = self.state.sick_gpus(gpu_states)
        if self.claim_holders is not None:  # DRA: who holds the GPU through a claim
            sick = with_claim_holders(sick, running, self.claim_holders)
        now = self.clock()
        self.evicted_at = {u: t for u, t in self.evicted_at.items() if now - t < EVICTED_HOLD_S}
        blocked = 0
        resets = self.resets
        if resets is None:
            decisions = drain(sick, running, fresh, self.rb.grace_s)
        else:
            reset_grace = {"reset_gpu": self.reset_grace_s}
            decisions = drain(sick, running, fresh, self.rb.grace_s, cordoned=self.cordoned,
                              grace_by_action=reset_grace)  # fmt: skip
        for d in decisions:
            if d.pod.uid in self.evicted_at:
                continue  # evicted a moment ago; the pod watch has not shown it going yet
            if not d.evict:
                blocked += 1
                if self.actions.event(
                    d.pod, "RebalanceSkipped", d.message, warning=True, dedupe=d.reason
                ):
                    self.metrics.skipped.labels("drain", d.reason).inc()  # once per pod
                continue
            if not self._evict(d, self.limits.allows(d.pod.node)):
                blocked += 1
        if resets is not None:
            total = sum(len(g) for g in gpu_states.values())
            resets.run(sick, running, fresh, total, self.state.unhealthy_since)
        return blocked

    def _defragment(
        self, pending: list[PodFacts], states: Mapping[str, Any], fresh: Mapping[str, bool],
        nodes: Mapping[str, NodeFacts], running: Mapping[str, PodFacts],
        degraded: Collection[str] = frozenset(),
    ) -> int:  # fmt: skip
        by_node: dict[str, list[PodFacts]] = {}
        for p in running.values():
            by_node.setdefault(p.node, []).append(p)
        now = self.clock()
        cooldown = max(2 * self.rb.interval_s, 30.0)  # its evictions still settling
        self.forget_rooms({p.uid for p in pending})
        placer = Placer(
            states, fresh, nodes, self.policy, by_node, profile=self.profile, degraded=degraded,
            policies=self.policies, now=self.state.wall(),
        )  # fmt: skip
        for pod in pending:
            if pod.shape.gpus <= 0 or pod.shape.mig or pod.gang or not pod.unschedulable:
                continue  # not a pod defragmentation makes room for
            if pod.uid in self.made_room_for:
                tries = self.room_tries.get(pod.uid, 1)
                wait = min(ROOM_BACKOFF_S * 2 ** (tries - 1), ROOM_BACKOFF_MAX_S)
                left = self.made_room_for[pod.uid] + wait - now
                if left > 0:
                    if now - self.made_room_for[pod.uid] >= cooldown:  # settled, still pending
                        msg = (f"room was made for it {tries} time(s) and it is still "
                               f"unschedulable; not again for {left:.0f} s")  # fmt: skip
                        self._skip(pod, "backoff", msg)
                    continue  # its evictions are still settling, or it is backing off
            if self._refuse(pod, placer):
                continue
            plan = defragment(pod, states, fresh, nodes, by_node, self.policy, placer)
            if plan is None:
                continue
            victims = ", ".join(v.key for v in plan.victims)
            if not self.limits.allows(plan.node, len(plan.victims)):
                self.metrics.skipped.labels("defrag", "rate_limited").inc()
                msg = (f"room for it on {plan.node} needs {len(plan.victims)} evictions "
                       f"({victims}); over the rate limit now")  # fmt: skip
                self.actions.event(
                    pod, "RebalanceSkipped", msg, warning=True, dedupe="rate_limited"
                )
                return len(plan.victims)
            refused = [(v, r) for v in plan.victims if (r := self.actions.eviction_refused(v))]
            if refused:
                who, why = refused[0]
                self.metrics.skipped.labels("defrag", why).inc()
                what = "a PodDisruptionBudget protects" if why == "refused_pdb" else "cannot evict"
                msg = f"room for it on {plan.node} needs evicting {victims}; {what} {who.key}"
                self.actions.event(pod, "RebalanceSkipped", msg, warning=True, dedupe=why)
                return len(plan.victims)
            if not self.rb.dry_run and not self.reserve(pod, plan.node):
                self.metrics.skipped.labels("defrag", "max_reservations").inc()
                return len(plan.victims)
            if not self.rb.dry_run and not self.commit(plan.node, len(plan.victims)):
                self.state.reservations.pop(pod.uid, None)
                return len(plan.victims)  # lost the Lease: the new leader decides
            kept = None if self.rb.dry_run else self.state.reservations.get(pod.uid)
            if kept is not None:  # the note on the pod too, for people
                self.actions.mirror(pod, plan.node, kept.until)
            verb = "would make" if self.rb.dry_run else "making"
            where = ", ".join(plan.targets)
            msg = f"{verb} room on {plan.node} by evicting {victims} (each fits now on: {where})"
            self.actions.event(pod, "RebalanceDefragment", msg)
            for v, target in zip(plan.victims, plan.targets, strict=True):
                msg = (f"to make room on {plan.node} for {pod.key} ({pod.shape.gpus} GPUs), "
                       f"which fits nowhere now; this pod fits on {target}")  # fmt: skip
                self._evict(Decision(v, "defrag", "make_room", msg, True), True, committed=True)
            self.made_room_for[pod.uid] = now
            self.room_tries[pod.uid] = self.room_tries.get(pod.uid, 0) + 1
            return 0  # one plan per pass: let the scheduler settle first
        return 0

    def _refuse(self, pod: PodFacts, placer: Placer) -> str:
        """The reason no room is made for `pod` at all ("" when it may be): another
        scheduler's pod, a namespace not in rebalance.namespaces, a pod no node could
        run even emptied, one whose placement the caches cannot foresee, or one whose
        policy annotation names no registered policy (the extender places it nowhere)."""
        if pod.scheduler != self.rb.scheduler_name:  # the watch selects them; a guard
            self._skip(pod, "scheduler", f"it is for scheduler {pod.scheduler!r}", event=False)
            return "scheduler"
        if self.namespaces and pod.namespace not in self.namespaces:
            # No Event: the rebalancer writes nothing in namespaces it does not serve.
            self._skip(pod, "namespace", "its namespace is not in rebalance.namespaces",
                       event=False)  # fmt: skip
            return "namespace"
        refused = placer.refusal(pod)
        if refused is None:
            return ""
        self._skip(pod, refused.reason, f"no room made for it: {refused.message}")
        return refused.reason

    def _skip(self, pod: PodFacts, reason: str, message: str, event: bool = True) -> None:
        """Count a pending pod left alone, once per EVENT_REPEAT_S, with an Event."""
        if event:
            if self.actions.event(pod, "RebalanceSkipped", message, warning=True, dedupe=reason):
                self.metrics.skipped.labels("defrag", reason).inc()
            return
        if self.actions.once((pod.uid, reason)):
            self.metrics.skipped.labels("defrag", reason).inc()
            logger.debug("rebalancer: not making room for {}: {}", pod.key, message)

    def forget_rooms(self, pending: set[str]) -> None:
        """Back-off state for pods still pending only, and at most MAX_BACKOFF_PODS."""
        for uid in [u for u in self.made_room_for if u not in pending]:
            del self.made_room_for[uid]
        if len(self.made_room_for) > MAX_BACKOFF_PODS:
            oldest = sorted(self.made_room_for, key=self.made_room_for.__getitem__)
            for uid in oldest[: len(oldest) - MAX_BACKOFF_PODS]:
                del self.made_room_for[uid]
        for uid in [u for u in self.room_tries if u not in self.made_room_for]:
            del self.room_tries[uid]
        self.actions.forget_told()

    # -- acting ---------------------------------------------------------------------

    def reserve(self, pod: PodFacts, node: str) -> bool:
        """Keep the room made on `node` for the pending pod; False: do not evict."""
        return self.state.reserve(
            Reservation(pod.uid, pod.key, node, pod.shape.gpus, pod.priority, 0.0),
            self.pending_uids(), self.rb.reserve_s, self.rb.max_reservations,
        )  # fmt: skip

    def _evict(self, d: Decision, allowed: bool, committed: bool = False) -> bool:
        """Evict (or, dry-run, say it would); True when done or planned. `committed`:
        already written into the Lease's rate-limit window by the caller."""
        pod = d.pod
        if self.rb.dry_run:
            msg = f"dry run: would evict: {d.message}"
            if self.actions.event(pod, "RebalanceWouldEvict", msg, dedupe="would"):
                self.metrics.evicted(d, "planned")  # once per pod
                logger.info("rebalancer (dry run): would evict {}: {}", pod.key, d.message)
            return True
        if not allowed:
            self.metrics.skipped.labels(d.kind, "rate_limited").inc()
            msg = f"{d.message}; over the rate limit now, later"
            self.actions.event(pod, "RebalanceSkipped", msg, warning=True, dedupe="rate_limited")
            return False
        if not committed and not self.commit(pod.node, 1):
            return False  # lost the Lease during the pass: the new leader decides
        try:
            self.actions.evict(pod)
        except KubeNotFoundError:
            self.limits.forget(pod.node)
            return True  # gone already
        except KubeError as e:
            self.limits.forget(pod.node)  # not evicted: it does not count
            if e.status == 429:
                self.metrics.evicted(d, "refused_pdb")
                msg = f"{d.message}; a PodDisruptionBudget does not allow it now, retried later"
                self.actions.event(pod, "RebalanceRefused", msg, warning=True, dedupe="pdb")
            else:
                self.metrics.evicted(d, "failed")
                logger.warning("rebalancer: evicting {} failed: {}", pod.key, e)
            return False
        self.metrics.evicted(d, "done")
        self.evicted_at[pod.uid] = self.clock()
        logger.info("rebalancer: evicted {}: {}", pod.key, d.message)
        self.actions.event(pod, "RebalanceEvicted", d.message)
        return True
