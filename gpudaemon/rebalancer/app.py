"""`gpudaemon rebalance`: the wiring and the leader loop. Watches Nodes, Leases and
pods into the shared `ClusterState` (the extender's free-GPU count and freshness rule;
the planner's own readings of Nodes and pods are registered there as views, so the
rebalancer keeps no mirror of its own), plans with `planner`, and, while it holds the
leader Lease and only with --apply, evicts through the Eviction API (so every
PodDisruptionBudget holds). Every decision is an Event on the pod.

Its parts: `metrics.py` (series), `ratelimit.py`, `state.py` (what the Lease carries),
`actions.py` (the API calls), `kube.runner` (start, readiness, /metrics, close).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from loguru import logger
from prometheus_client import CollectorRegistry

from gpudaemon import __version__
from gpudaemon.cluster.clusterstate import ClusterState
from gpudaemon.cluster.metrics import BadDataCollector
from gpudaemon.cluster.policies import build_policies, policy_spec
from gpudaemon.cluster.reservations import REBALANCER_LEASE, Reservation
from gpudaemon.cluster.selectors import POD_SELECTOR, pending_selector
from gpudaemon.config import Config
from gpudaemon.errors import ConfigError, KubeError, KubeNotFoundError
from gpudaemon.httpserver import HttpServer
from gpudaemon.kube.backoff import Backoff
from gpudaemon.kube.client import KubeClient, find_credentials
from gpudaemon.kube.informer import Reflector
from gpudaemon.kube.leader import LeaderElector
from gpudaemon.kube.lease import lease_path
from gpudaemon.kube.runner import Runner, observability_app
from gpudaemon.labels.annotations import GpuState, decode_gpus
from gpudaemon.labels.keys import GPUS_ANNOTATION
from gpudaemon.rebalancer.actions import Actions
from gpudaemon.rebalancer.metrics import RebalancerMetrics
from gpudaemon.rebalancer.planner import (
    Decision,
    NodeFacts,
    Placer,
    PodFacts,
    defragment,
    drain,
    node_facts,
    pod_facts,
)
from gpudaemon.rebalancer.ratelimit import RateLimit
from gpudaemon.rebalancer.state import STATE_ANNOTATION, LeaseState
from gpudaemon.selector import selector_matcher

LEASE_NAME = REBALANCER_LEASE
# A pod its room was made for and that stays unschedulable is not made room for again
# until this has passed, doubled for each further try, up to the cap; at most this many
# pods are remembered (the oldest go first). Kept in memory only: a restart forgets it.
ROOM_BACKOFF_S = 600.0
ROOM_BACKOFF_MAX_S = 6 * 3600.0
MAX_BACKOFF_PODS = 10_000


class Rebalancer:
    def __init__(
        self,
        cfg: Config,
        identity: str,
        client: KubeClient | None = None,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.cfg, self.rb = cfg, cfg.rebalance
        self.identity = identity
        self.clock, self.wall = clock, wall
        policy_spec(cfg.extender.policy)  # an unknown policy is one line, exit 2
        self.policy = build_policies(cfg.extender)[cfg.extender.policy]
        if client is None:
            creds = find_credentials(cfg.kubernetes.kubeconfig, bool(cfg.kubernetes.in_cluster))
            if creds is None:
                raise ConfigError(
                    "the rebalancer needs Kubernetes credentials: run in a cluster or set "
                    "kubernetes.kubeconfig (or $KUBECONFIG)"
                )
            client = KubeClient.from_credentials(
                creds,
                cfg.kubernetes.request_timeout_seconds,
                cfg.kubernetes.connect_timeout_seconds,
            )
        self.kube = client
        self.registry = registry or CollectorRegistry()
        self.metrics = RebalancerMetrics(self.registry)
        self.metrics.dry_run.set(1 if self.rb.dry_run else 0)
        self.gpus_key = cfg.labels.prefix + GPUS_ANNOTATION
        self.selector = selector_matcher(self.rb.selector)
        # The planner's readings of Nodes and bound pods, kept in the shared store.
        self.cluster = ClusterState(
            cfg.labels.prefix, wall=wall, node_view=self._node_view, pod_view=self._parse
        )
        self.product_label = self.cluster.product_label
        self._lock = threading.Lock()  # guards `pending`
        self.pending: dict[str, PodFacts] = {}  # by UID: this scheduler's unbound pods
        self._made_room_for: dict[str, float] = {}  # pending UID -> when its plan ran
        self._room_tries: dict[str, int] = {}  # pending UID -> plans run for it
        self.namespaces = frozenset(self.rb.namespaces)  # empty: every namespace
        self.limits = RateLimit(
            self.rb.max_evictions_per_minute, self.rb.max_evictions_per_node, clock
        )
        self.state = LeaseState(self.limits, wall)
        self.actions = Actions(client, identity, clock, wall)
        self.elector = LeaderElector(
            client, cfg.kubernetes.lease_namespace, LEASE_NAME, identity,
            self.rb.lease_duration_s, wall=wall, clock=clock,
            state_key=STATE_ANNOTATION, save=self.state.save, load=self.state.load,
            annotations=self._lease_annotations,
        )  # fmt: skip
        cap = cfg.kubernetes.backoff_max_seconds
        c = self.cluster
        self.reflectors = [
            Reflector(client, "nodes", "/api/v1/nodes", c.replace_nodes, c.node_event,
                      backoff=Backoff(0.5, cap)),
            Reflector(client, "pods", "/api/v1/pods", c.replace_pods, c.pod_event,
                      query={"fieldSelector": POD_SELECTOR}, backoff=Backoff(0.5, cap)),
            Reflector(client, "leases", lease_path(cfg.kubernetes.lease_namespace),
                      c.replace_leases, c.lease_event, backoff=Backoff(0.5, cap)),
            Reflector(client, "pending", "/api/v1/pods", self._pending_replace,
                      self._pending_event, backoff=Backoff(0.5, cap),
                      query={"fieldSelector": pending_selector(self.rb.scheduler_name)}),
        ]  # fmt: skip
        self.runner = Runner(self.reflectors, clock=clock)
        self.registry.register(BadDataCollector(
            "rebalancer", self.cluster.bad_counts, self.runner.handler_errors
        ))  # fmt: skip
        self.server = HttpServer(
            self.rb.listen, observability_app(self.registry, self.ready), name="rebalance",
            threads=2,
        )  # fmt: skip
        self.runner.servers = [self.server]
        self.stop_event = self.runner.stop_event

    @property
    def reservations(self) -> dict[str, Reservation]:
        """The room kept for pending pods, by pod UID (`state.LeaseState`)."""
        return self.state.reservations

    # -- caches -------------------------------------------------------------------

    def _node_view(self, obj: Mapping[str, Any]) -> tuple[NodeFacts, list[GpuState]]:
        """What the planner reads of a Node beyond its NodeState: placement facts and the
        agent's per-GPU health. Kept by ClusterState only for Nodes whose agent data it
        could read: nothing is drained from the others or moved onto them."""
        meta = obj.get("metadata") or {}
        gpus = decode_gpus((meta.get("annotations") or {}).get(self.gpus_key) or "[]")
        return node_facts(obj), gpus

    def _parse(self, obj: Mapping[str, Any]) -> PodFacts | None:
        return pod_facts(obj, self.product_label, self.selector)

    def _pending_replace(self, items: list[dict[str, Any]]) -> None:
        with self._lock:
            self.pending = {p.uid: p for o in items if (p := self._parse(o)) is not None}

    def _pending_event(self, kind: str, obj: dict[str, Any]) -> None:
        uid = str((obj.get("metadata") or {}).get("uid") or "")
        with self._lock:
            pod = None if kind == "DELETED" else self._parse(obj)
            if pod is None or pod.node:
                self.pending.pop(uid, None)
            else:
                self.pending[uid] = pod

    def synced(self) -> bool:
        return self.runner.synced()

    # -- state kept on the Lease -----------------------------------------------------

    def _live_reservations(self) -> list[Reservation]:
        """Drop the reservations whose pod is bound or gone, or whose time ran out."""
        with self._lock:
            return self.state.live_reservations(self.pending)

    def _lease_annotations(self) -> dict[str, str]:
        """Written with every Lease write: the reservations the extender honours."""
        with self._lock:
            return self.state.annotations(self.pending)

    def _commit(self, node: str, count: int) -> bool:
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

    # -- a pass ---------------------------------------------------------------------

    def run_pass(self) -> None:
        """One pass (the leader only): drain, then at most one defragmentation plan."""
        self.metrics.passes.inc()
        with self.metrics.pass_seconds.time():
            self._pass()

    def facts(
        self,
    ) -> tuple[dict[str, NodeFacts], dict[str, list[GpuState]], dict[str, PodFacts]]:
        """The planner's readings from the shared store, as of one moment: node facts
        and GPU health by node, and the bound pods by "ns/name"."""
        views = self.cluster.views()
        nodes = {n: v[0] for n, v in views.nodes.items()}
        gpu_states = {n: v[1] for n, v in views.nodes.items()}
        return nodes, gpu_states, {p.key: p for p in views.pods.values()}

    def _pass(self) -> None:
        nodes, gpu_states, running = self.facts()
        with self._lock:
            pending = sorted(self.pending.values(), key=lambda p: (-p.priority, p.key))
        names = list(nodes)
        snap = self.cluster.snapshot(names)
        blocked = 0
        blocked += self._drain(gpu_states, running, snap.fresh)
        blocked += self._defragment(pending, snap.states, snap.fresh, nodes, running)
        self.metrics.blocked.set(blocked)

    def _drain(
        self, gpu_states: Mapping[str, list[GpuState]], running: Mapping[str, PodFacts],
        fresh: Mapping[str, bool],
    ) -> int:  # fmt: skip
        sick = self.state.sick_gpus(gpu_states)
        blocked = 0
        for d in drain(sick, running, fresh, self.rb.grace_s):
            if not d.evict:
                blocked += 1
                if self.actions.event(
                    d.pod, "RebalanceSkipped", d.message, warning=True, dedupe=d.reason
                ):
                    self.metrics.skipped.labels("drain", d.reason).inc()  # once per pod
                continue
            if not self._evict(d, self.limits.allows(d.pod.node)):
                blocked += 1
        return blocked

    def _defragment(
        self, pending: list[PodFacts], states: Mapping[str, Any], fresh: Mapping[str, bool],
        nodes: Mapping[str, NodeFacts], running: Mapping[str, PodFacts],
    ) -> int:  # fmt: skip
        by_node: dict[str, list[PodFacts]] = {}
        for p in running.values():
            by_node.setdefault(p.node, []).append(p)
        now = self.clock()
        cooldown = max(2 * self.rb.interval_s, 30.0)  # its evictions still settling
        self._forget_rooms({p.uid for p in pending})
        placer = Placer(states, fresh, nodes, self.policy, by_node)
        for pod in pending:
            if pod.shape.gpus <= 0 or pod.shape.mig or pod.gang or not pod.unschedulable:
                continue  # not a pod defragmentation makes room for
            if pod.uid in self._made_room_for:
                tries = self._room_tries.get(pod.uid, 1)
                wait = min(ROOM_BACKOFF_S * 2 ** (tries - 1), ROOM_BACKOFF_MAX_S)
                left = self._made_room_for[pod.uid] + wait - now
                if left > 0:
                    if now - self._made_room_for[pod.uid] >= cooldown:  # settled, still pending
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
            if not self.rb.dry_run and not self._reserve(pod, plan.node):
                self.metrics.skipped.labels("defrag", "max_reservations").inc()
                return len(plan.victims)
            if not self.rb.dry_run and not self._commit(plan.node, len(plan.victims)):
                self.reservations.pop(pod.uid, None)
                return len(plan.victims)  # lost the Lease: the new leader decides
            kept = None if self.rb.dry_run else self.reservations.get(pod.uid)
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
            self._made_room_for[pod.uid] = now
            self._room_tries[pod.uid] = self._room_tries.get(pod.uid, 0) + 1
            return 0  # one plan per pass: let the scheduler settle first
        return 0

    def _refuse(self, pod: PodFacts, placer: Placer) -> str:
        """The reason no room is made for `pod` at all ("" when it may be): another
        scheduler's pod, a namespace not in rebalance.namespaces, a pod no node could
        run even emptied, or one whose placement the caches cannot foresee."""
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

    def _forget_rooms(self, pending: set[str]) -> None:
        """Back-off state for pods still pending only, and at most MAX_BACKOFF_PODS."""
        for uid in [u for u in self._made_room_for if u not in pending]:
            del self._made_room_for[uid]
        if len(self._made_room_for) > MAX_BACKOFF_PODS:
            oldest = sorted(self._made_room_for, key=self._made_room_for.__getitem__)
            for uid in oldest[: len(oldest) - MAX_BACKOFF_PODS]:
                del self._made_room_for[uid]
        for uid in [u for u in self._room_tries if u not in self._made_room_for]:
            del self._room_tries[uid]
        self.actions.forget_told()

    # -- acting ---------------------------------------------------------------------

    def _reserve(self, pod: PodFacts, node: str) -> bool:
        """Keep the room made on `node` for the pending pod; False: do not evict."""
        with self._lock:
            return self.state.reserve(
                Reservation(pod.uid, pod.key, node, pod.shape.gpus, pod.priority, 0.0),
                self.pending, self.rb.reserve_s, self.rb.max_reservations,
            )  # fmt: skip

    def _evict(self, d: Decision, allowed: bool, committed: bool = False) -> bool:
        """Evict (or, dry-run, say it would); True when done or planned. `committed`:
        already written into the Lease's rate-limit window by the caller."""
        pod = d.pod
        if self.rb.dry_run:
            msg = f"dry run: would evict: {d.message}"
            if self.actions.event(pod, "RebalanceWouldEvict", msg, dedupe="would"):
                self.metrics.evictions.labels(d.kind, "planned").inc()  # once per pod
                logger.info("rebalancer (dry run): would evict {}: {}", pod.key, d.message)
            return True
        if not allowed:
            self.metrics.skipped.labels(d.kind, "rate_limited").inc()
            msg = f"{d.message}; over the rate limit now, later"
            self.actions.event(pod, "RebalanceSkipped", msg, warning=True, dedupe="rate_limited")
            return False
        if not committed and not self._commit(pod.node, 1):
            return False  # lost the Lease during the pass: the new leader decides
        try:
            self.actions.evict(pod)
        except KubeNotFoundError:
            self.limits.forget(pod.node)
            return True  # gone already
        except KubeError as e:
            self.limits.forget(pod.node)  # not evicted: it does not count
            if e.status == 429:
                self.metrics.evictions.labels(d.kind, "refused_pdb").inc()
                msg = f"{d.message}; a PodDisruptionBudget does not allow it now, retried later"
                self.actions.event(pod, "RebalanceRefused", msg, warning=True, dedupe="pdb")
            else:
                self.metrics.evictions.labels(d.kind, "failed").inc()
                logger.warning("rebalancer: evicting {} failed: {}", pod.key, e)
            return False
        self.metrics.evictions.labels(d.kind, "done").inc()
        logger.info("rebalancer: evicted {}: {}", pod.key, d.message)
        self.actions.event(pod, "RebalanceEvicted", d.message)
        return True

    def ready(self) -> tuple[bool, str]:
        return self.runner.ready()

    def start(self) -> None:
        self.runner.start()  # the server first: a bad listen address exits 2 before any API call
        mode = "dry run (log and Events only; --apply to act)" if self.rb.dry_run else "applying"
        logger.info("gpudaemon {} rebalancer {} on {} as {}: {}", __version__, "listening",
                    self.server.listen, self.identity, mode)  # fmt: skip

    def loop(self) -> None:
        """Elect, then a pass every interval while leading and synced."""
        renew = max(1.0, self.rb.lease_duration_s / 3)
        next_pass = self.clock()
        while not self.stop_event.is_set():
            leading = self.elector.try_acquire_or_renew()
            self.metrics.leader.set(1 if leading else 0)
            if not leading:
                self.reservations.clear()  # a new leader starts with none
            if leading and self.synced() and self.clock() >= next_pass:
                try:
                    self.run_pass()
                except Exception as e:  # a bug must not stop the loop
                    logger.exception("rebalancer: pass failed: {}", e)
                next_pass = self.clock() + self.rb.interval_s
            wait = self.elector.retry_in(renew)
            if leading:
                wait = min(wait, max(0.2, next_pass - self.clock()))
            self.stop_event.wait(wait)

    def run(self) -> int:
        self.start()
        try:
            self.loop()
        finally:
            self.close()
        return 0

    def close(self) -> None:
        self.stop_event.set()
        self.reservations.clear()
        self.elector.release()
        self.metrics.leader.set(0)
        self.runner.close()
