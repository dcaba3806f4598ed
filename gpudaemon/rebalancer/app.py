"""`gpudaemon rebalance`: the wiring and the leader loop. Watches Nodes, Leases and
pods into the shared `ClusterState` (the extender's free-GPU count and freshness rule;
the planner's own readings of Nodes and pods are registered there as views, so the
rebalancer keeps no mirror of its own), plans with `planner`, and, while it holds the
leader Lease and only with --apply, evicts through the Eviction API (so every
PodDisruptionBudget holds). Every decision is an Event on the pod.

Between the regular passes (rebalance.interval_s) a drain-only pass runs when the Node
watch shows a GPU newly needing a drain (`wake.py`) and when a sick GPU's grace runs
out, so a verdict is acted on when it arrives, not up to an interval later.

Its parts: `passes.py` (one pass's decisions and acts), `metrics.py` (series),
`ratelimit.py`, `state.py` (what the Lease carries), `actions.py` (the API calls),
`wake.py` (what wakes the loop), and the shared `kube.runner` (start, readiness,
/metrics, close).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from loguru import logger
from prometheus_client import CollectorRegistry

from gpudaemon import __version__
from gpudaemon.cluster.clusterstate import ClusterState
from gpudaemon.cluster.drawatch import dra_informers
from gpudaemon.cluster.metrics import BadDataCollector, DraCollector
from gpudaemon.cluster.plugins import build_profile, check_plugins
from gpudaemon.cluster.policies import build_policies, policy_spec
from gpudaemon.cluster.reservations import REBALANCER_LEASE, Reservation
from gpudaemon.cluster.selectors import POD_FORM, pending_selector
from gpudaemon.config import RebalancerSettings
from gpudaemon.errors import ConfigError
from gpudaemon.httpserver import HttpServer
from gpudaemon.kube.client import KubeClient, find_credentials
from gpudaemon.kube.informers import InformerFactory, Store, uid_key
from gpudaemon.kube.leader import LeaderElector
from gpudaemon.kube.runner import Runner, observability_app
from gpudaemon.labels.annotations import GpuState, decode_gpus
from gpudaemon.labels.keys import GPUS_ANNOTATION
from gpudaemon.rebalancer.actions import Actions
from gpudaemon.rebalancer.metrics import RebalancerMetrics
from gpudaemon.rebalancer.passes import Pass
from gpudaemon.rebalancer.planner import (
    NodeFacts,
    PlacementHandle,
    PodFacts,
    node_facts,
    pod_facts,
)
from gpudaemon.rebalancer.ratelimit import RateLimit
from gpudaemon.rebalancer.resets import GrantWatch, ResetGrants
from gpudaemon.rebalancer.state import STATE_ANNOTATION, LeaseState
from gpudaemon.rebalancer.wake import SickWatch
from gpudaemon.remediation.grant import GRANT_ANNOTATION
from gpudaemon.selector import selector_matcher

LEASE_NAME = REBALANCER_LEASE
# How soon a stop set from a signal handler ends the loop's wait: the handler sets only
# `stop_event`, and a wait on the wake event does not see it.
STOP_POLL_S = 0.25
# A drain pass for a grace's end runs this much after it: the pass reads the wall clock
# again, and one a hair early would find the grace still running.
GRACE_MARGIN_S = 0.01
# Drain-only passes start at least this long after the last pass: a burst of verdicts
# (a rack losing power) is a few passes a second, not one per Node event.
DRAIN_GAP_S = 0.25
# While a GPU waits for its reset: a drain pass this often (its holders' deletions are
# pod events, which do not wake the loop).
RESET_POLL_S = 1.0


GANG_INDEX = "gang"  # the pending store's index: "ns/podgroup" -> its pending pods


def cordoned(nodes: Mapping[str, NodeFacts]) -> frozenset[str]:
    return frozenset(n for n, f in nodes.items() if f.unschedulable)


class PendingPods:
    """The pending store as the plug-ins read pending pods (cluster/plugins/base.py
    `PendingView`): by UID, and by gang through the store's index."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def get(self, uid: str) -> PodFacts | None:
        got: PodFacts | None = self.store.get(uid)
        return got

    def gang_members(self, gang: str) -> list[PodFacts]:
        return list(self.store.by_index(GANG_INDEX, gang))


class Rebalancer:
    def __init__(
        self,
        cfg: RebalancerSettings,
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
        check_plugins(cfg.extender.plugins)  # so is an unknown plug-in
        self.policies = build_policies(cfg.extender)
        self.policy = self.policies[cfg.extender.policy]
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
            cfg.labels.prefix,
            wall=wall,
            node_view=self._node_view,
            pod_view=self._parse,
            dra=cfg.dra.enabled,
        )
        self.product_label = self.cluster.product_label
        self._lock = threading.Lock()  # guards the Lease state against the passes
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
        # Set by the Node watch when a GPU newly needs a drain, and by close().
        self.wake = threading.Event()
        self.sick_watch = SickWatch(self.gpus_key, self.wake)
        # GPU resets in place (remediation.reset_gpu): the grants on the Nodes.
        self.grant_watch = GrantWatch(cfg.labels.prefix + GRANT_ANNOTATION)
        c = self.cluster
        # One list + watch per resource and selector; each cache registers its handlers.
        f = self.informers = InformerFactory(
            client, backoff_max_s=cfg.kubernetes.backoff_max_seconds, clock=clock
        )
        # Nodes and bound pods: their stores hold ClusterState's records of them (the
        # planner's readings among them, as its views), which it reads as its view.
        nodes, _, _ = c.watch(f, cfg.kubernetes.lease_namespace)
        nodes.add_handler(self.grant_watch.replace, self.grant_watch.node_event)
        # Last: a drain pass it wakes sees the nodes.
        nodes.add_handler(self.sick_watch.replace, self.sick_watch.node_event)
        mine = {"fieldSelector": pending_selector(self.rb.scheduler_name)}
        pending = f.informer("pending", "/api/v1/pods", mine, keep=self._pending_keep,
                             key=uid_key, **POD_FORM)  # fmt: skip
        assert pending.store is not None  # store=True above
        self._pending: Store = pending.store  # by UID: this scheduler's unbound pods
        self._pending.add_indexer(GANG_INDEX, lambda p: [p.gang] if p.gang else [])
        # The policies learn as the extender's do (one model): node capacities from the
        # Node store, the workload from the pods arriving at our scheduler (the pods the
        # extender sees at /filter), each UID once. Without it a learning policy
        # (fragmentation) would rank victims' hosts with an empty workload.
        for p in self.policies.values():
            self.cluster.add_node_listener(p)
        pending.add_store_handler(self._learn_all, self._learn)
        # Where a pod would land: the extender's own plug-in profile (`extender.plugins`),
        # built as the extender builds it, so a victim is placed by the extender's rules;
        # `reserved` reads this replica's pending pods and the rooms it keeps itself.
        ext = cfg.extender
        handle = PlacementHandle(
            self.cluster, self.policies, ext.avoid_unhealthy_nodes, ext.prefer_healthy_gpus,
            pending=PendingPods(self._pending), reservations=self.state,
        )  # fmt: skip
        self.profile = build_profile(ext.plugins, handle)
        self.passes = Pass(
            self.rb, self.policy, self.metrics, self.actions, self.state, self.elector,
            self._pending_uids, clock, self.profile, self.policies,
        )  # fmt: skip
        if cfg.remediation.reset_gpu:
            rem = cfg.remediation
            self.passes.resets = ResetGrants(
                rem, self.rb.dry_run, client, self.grant_watch,
                count=lambda result: self.metrics.resets.labels(result).inc(),
                breaker=lambda is_open: self.metrics.reset_breaker_open.set(1 if is_open else 0),
                checkpoint=self.elector.checkpoint, wall=wall,
            )  # fmt: skip
            self.passes.reset_grace_s = rem.drain_grace_s
        if cfg.dra.enabled:  # pods holding a sick GPU through a DRA claim
            dra_informers(f, c)
            self.passes.claim_holders = c.dra_holders
        self.reflectors = f.reflectors
        self.runner = Runner(self.reflectors, clock=clock)
        self.registry.register(DraCollector("rebalancer", self.cluster.dra_counts, claims=False))
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

    def _pending_keep(self, obj: Mapping[str, Any]) -> PodFacts | None:
        """The pending store's form of a pod; None (not kept) once it has a node."""
        pod = self._parse(obj)
        return None if pod is None or pod.node else pod

    def _learn_all(self, old: Mapping[str, PodFacts], new: Mapping[str, PodFacts]) -> None:
        for key, pod in new.items():
            self._learn("ADDED", key, old.get(key), pod)

    def _learn(self, kind: str, key: str, old: PodFacts | None, new: PodFacts | None) -> None:
        if new is not None and old is None and new.shape.wants_gpus:
            for p in self.policies.values():
                p.observe_pod(new.uid, new.shape)

    @property
    def pending(self) -> dict[str, PodFacts]:
        """This scheduler's unbound pods by UID, as of now (a copy)."""
        return {p.uid: p for p in self._pending.items()}

    def _pending_replace(self, items: list[dict[str, Any]]) -> None:
        """A relist, into the store (what the informer does)."""
        self._pending.replace(items)

    def _pending_event(self, kind: str, obj: dict[str, Any]) -> None:
        """A watch event, into the store (what the informer does)."""
        self._pending.apply(kind, obj)

    def synced(self) -> bool:
        return self.runner.synced()

    # -- state kept on the Lease -----------------------------------------------------

    def _pending_uids(self) -> frozenset[str]:
        return frozenset(self._pending.keys())

    def _lease_annotations(self) -> dict[str, str]:
        """Written with every Lease write: the reservations the extender honours."""
        with self._lock:
            return self.state.annotations(self.pending)

    # -- a pass ---------------------------------------------------------------------

    def run_pass(self) -> None:
        """One pass (the leader only): drain, then at most one defragmentation plan."""
        self.metrics.passes.inc()
        with self.metrics.pass_seconds.time():
            self._pass()

    def run_drain_pass(self) -> None:
        """A drain-only pass (the leader only), counted and timed as a pass."""
        self.metrics.passes.inc()
        with self.metrics.pass_seconds.time():
            nodes, gpu_states, running = self.facts()
            self.passes.cordoned = cordoned(nodes)
            fresh = self.cluster.freshness(gpu_states)
            blocked = self.passes.drain_pass(gpu_states, running, fresh)
        self.metrics.blocked.set(blocked)

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
        snap = self.cluster.snapshot(list(nodes))
        self.passes.cordoned = cordoned(nodes)
        blocked = self.passes.run(
            nodes, gpu_states, running, pending, snap.states, snap.fresh, snap.degraded
        )
        self.metrics.blocked.set(blocked)

    def ready(self) -> tuple[bool, str]:
        return self.runner.ready()

    def start(self) -> None:
        self.runner.start()  # the server first: a bad listen address exits 2 before any API call
        mode = "dry run (log and Events only; --apply to act)" if self.rb.dry_run else "applying"
        logger.info("gpudaemon {} rebalancer {} on {} as {}: {}", __version__, "listening",
                    self.server.listen, self.identity, mode)  # fmt: skip

    def loop(self) -> None:
        """Elect, then a pass every interval while leading and synced; between them a
        drain-only pass when woken (a GPU newly needs a drain) or when a sick GPU's
        grace runs out. A wake renews no Lease: an eviction checkpoints it anyway."""
        renew = max(1.0, self.rb.lease_duration_s / 3)
        next_pass = next_renew = self.clock()
        last_pass = -math.inf
        drain_at: float | None = None  # the next drain-only pass: woken, or a grace's end
        leading = False
        while not self.stop_event.is_set():
            if self.wake.is_set():
                self.wake.clear()  # before the pass: a verdict during it wakes the next
                at = max(self.clock(), last_pass + DRAIN_GAP_S)
                drain_at = at if drain_at is None else min(drain_at, at)
            renewing = self.clock() >= next_renew
            if renewing:
                leading = self.elector.try_acquire_or_renew()
                self.metrics.leader.set(1 if leading else 0)
                if not leading:
                    self.reservations.clear()  # a new leader starts with none
            else:
                leading = self.elector.leading  # past its renew deadline: stop acting
            if not (leading and self.synced()):
                drain_at = None  # the first pass once leading and synced drains anyway
            elif (now := self.clock()) >= next_pass or (drain_at is not None and now >= drain_at):
                regular = now >= next_pass
                self._guarded(self.run_pass if regular else self.run_drain_pass)
                last_pass = self.clock()
                if regular:
                    next_pass = last_pass + self.rb.interval_s
                drain_at = self._grace_end(last_pass, next_pass)
            if renewing:
                next_renew = self.clock() + self.elector.retry_in(renew)
            wait = next_renew - self.clock()
            if leading:
                wait = min(wait, max(0.2, next_pass - self.clock()))
                if drain_at is not None:
                    wait = min(wait, max(0.01, drain_at - self.clock()))
            self._sleep(wait)

    @staticmethod
    def _guarded(run: Callable[[], None]) -> None:
        try:
            run()
        except Exception as e:  # a bug must not stop the loop
            logger.exception("rebalancer: pass failed: {}", e)

    def _grace_end(self, last_pass: float, next_pass: float) -> float | None:
        """When (monotonic) a sick GPU's grace runs out, if before the next regular
        pass: its drain then is not an interval late. The grace clocks are wall times.
        While a GPU waits for its reset (its holders going, a grant out), every
        RESET_POLL_S."""
        resets = self.passes.resets
        grace = self.rb.grace_s
        if resets is not None:
            grace = min(grace, self.cfg.remediation.drain_grace_s)
        left = self.state.grace_left(grace)
        at = None
        if left is not None:
            at = max(self.clock() + left + GRACE_MARGIN_S, last_pass + DRAIN_GAP_S)
        if resets is not None and resets.waiting:
            poll = last_pass + RESET_POLL_S
            at = poll if at is None else min(at, poll)
        return at if at is not None and at < next_pass else None

    def _sleep(self, seconds: float) -> None:
        """Until `seconds` pass, a wake, or a stop, whichever comes first (on the real
        clock: Event.wait sleeps on it, whatever clock the loop was given)."""
        deadline = time.monotonic() + seconds
        while not self.stop_event.is_set():
            left = deadline - time.monotonic()
            if left <= 0 or self.wake.wait(min(left, STOP_POLL_S)):
                return

    def run(self) -> int:
        self.start()
        try:
            self.loop()
        finally:
            self.close()
        return 0

    def close(self) -> None:
        self.stop_event.set()
        self.wake.set()  # the loop, if waiting, sees the stop at once
        self.reservations.clear()
        self.elector.release()
        self.metrics.leader.set(0)
        self.runner.close()
