"""`gpudaemon rebalance`: the wiring. Watches Nodes, Leases and pods into the extender's
own `ClusterState` (the same free-GPU count and freshness rule), plans with `planner`,
and, while it holds the leader Lease and only with --apply, evicts through the Eviction
API (so every PodDisruptionBudget holds). Every decision is an Event on the pod.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from loguru import logger
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from gpudaemon import __version__
from gpudaemon.cluster.clusterstate import ClusterState
from gpudaemon.cluster.metrics import BadDataCollector
from gpudaemon.cluster.policies import build_policies, policy_spec
from gpudaemon.cluster.reservations import (
    MAX_RESERVE_S,
    REBALANCER_LEASE,
    RESERVATIONS_ANNOTATION,
    RESERVED_NODE_ANNOTATION,
    RESERVED_UNTIL_ANNOTATION,
    Reservation,
    encode,
)
from gpudaemon.cluster.selectors import POD_SELECTOR, pending_selector
from gpudaemon.config import Config
from gpudaemon.errors import BadValueError, ConfigError, KubeError, KubeNotFoundError
from gpudaemon.httpserver import HttpServer, StartResponse, probe_response, text_response
from gpudaemon.kube.backoff import Backoff
from gpudaemon.kube.client import KubeClient, find_credentials
from gpudaemon.kube.informer import Reflector
from gpudaemon.kube.leader import LeaderElector
from gpudaemon.kube.lease import lease_path, micro_time
from gpudaemon.labels.annotations import GpuState, decode_gpus
from gpudaemon.labels.keys import GPUS_ANNOTATION
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
from gpudaemon.selector import selector_matcher

LEASE_NAME = REBALANCER_LEASE
# On the leader Lease: the rate-limit window and when each sick GPU was first seen, so
# a restarted or new leader neither evicts past the limit nor starts the grace again.
STATE_ANNOTATION = "gpudaemon.io/rebalancer-state"
MAX_SAVED_SICK_GPUS = 2000  # keeps the annotation far below the 256 KiB object limit
COMPONENT = "gpudaemon-rebalancer"
EVENT_REPEAT_S = 600.0  # the same Event for the same pod at most this often
RESULTS = ("planned", "done", "refused_pdb", "failed")
SKIPS = ("bare_pod", "stale", "rate_limited", "refused_pdb", "api_error", "max_reservations")
# Why no room is made for a pending pod at all (kind "defrag" only).
DEFRAG_SKIPS = ("never_fits", "cannot_judge", "namespace", "scheduler", "backoff")
# A pod its room was made for and that stays unschedulable is not made room for again
# until this has passed, doubled for each further try, up to the cap; at most this many
# pods are remembered (the oldest go first). Kept in memory only: a restart forgets it.
ROOM_BACKOFF_S = 600.0
ROOM_BACKOFF_MAX_S = 6 * 3600.0
MAX_BACKOFF_PODS = 10_000


class RebalancerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.evictions = Counter(
            "gpudaemon_rebalancer_evictions",
            "Evictions by kind (drain, defrag) and result: planned (dry-run: what it would "
            "do), done, refused_pdb (a PodDisruptionBudget said no; retried later), failed.",
            ["kind", "result"],
            registry=registry,
        )
        self.skipped = Counter(
            "gpudaemon_rebalancer_skipped",
            "Pods or plans left alone, by kind and reason: bare_pod (no controller would "
            "re-create it), stale (agent data too old), rate_limited, refused_pdb (a plan "
            "one of whose victims a PodDisruptionBudget protects), api_error, max_reservations "
            "(as many rooms kept as rebalance.max_reservations allows); defrag only, "
            "counted with each Event (per pod at most every 10 min): never_fits (no node "
            "could run it even emptied), "
            "cannot_judge (its placement depends on what the caches cannot tell), "
            "namespace (not in rebalance.namespaces), scheduler (another scheduler's pod), "
            "backoff (its room was made and it still did not schedule).",
            ["kind", "reason"],
            registry=registry,
        )
        self.blocked = Gauge(
            "gpudaemon_rebalancer_blocked_pods",
            "Pods the last pass wanted to evict but could not (PDB, rate limit, bare pod, "
            "stale data): what the GpudaemonRebalancerBlocked alert watches.",
            registry=registry,
        )
        self.leader = Gauge(
            "gpudaemon_rebalancer_leader",
            "1 while this replica holds the Lease.",
            registry=registry,
        )
        self.dry_run = Gauge(
            "gpudaemon_rebalancer_dry_run",
            "1 when it only logs and emits Events.",
            registry=registry,
        )
        self.passes = Counter(
            "gpudaemon_rebalancer_passes", "Passes run while leading.", registry=registry
        )
        self.pass_seconds = Histogram(
            "gpudaemon_rebalancer_pass_duration_seconds",
            "Time one pass takes (planning and the API calls it makes); the pass "
            "interval must stay well above it.",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=registry,
        )
        for kind in ("drain", "defrag"):
            for r in RESULTS:
                self.evictions.labels(kind, r)
            for s in SKIPS:
                self.skipped.labels(kind, s)
        for s in DEFRAG_SKIPS:
            self.skipped.labels("defrag", s)


class RateLimit:
    """At most `per_minute` evictions in any 60 s, and `per_node` on one node. The
    window is kept in the leader Lease (`export`/`load`, wall-clock seconds), so neither
    a restart nor a new leader starts it afresh."""

    def __init__(self, per_minute: int, per_node: int, clock: Callable[[], float]) -> None:
        self.per_minute, self.per_node, self.clock = per_minute, per_node, clock
        self._done: deque[tuple[float, str]] = deque()

    def _prune(self) -> None:
        now = self.clock()
        while self._done and now - self._done[0][0] >= 60.0:
            self._done.popleft()

    def room(self, node: str) -> tuple[int, int]:
        self._prune()
        on_node = sum(1 for _, n in self._done if n == node)
        return self.per_minute - len(self._done), self.per_node - on_node

    def allows(self, node: str, count: int = 1) -> bool:
        total, node_room = self.room(node)
        return count <= total and count <= node_room

    def record(self, node: str) -> None:
        self._done.append((self.clock(), node))

    def forget(self, node: str) -> None:
        """Take back the newest record for `node` (an eviction that did not happen)."""
        for i in range(len(self._done) - 1, -1, -1):
            if self._done[i][1] == node:
                del self._done[i]
                return

    def export(self, wall_now: float) -> list[list[Any]]:
        self._prune()
        now = self.clock()
        return [[round(wall_now - (now - t), 3), n] for t, n in self._done]

    def load(self, entries: Iterable[Any], wall_now: float) -> None:
        """Add another holder's window (wall times); entries we hold already, or that
        are malformed, are left out."""
        now = self.clock()
        have = {(round(w, 3), n) for w, n in self.export(wall_now)}
        merged = list(self._done)
        for e in entries:
            if not (isinstance(e, list) and len(e) == 2 and isinstance(e[1], str)
                    and isinstance(e[0], int | float)):  # fmt: skip
                continue
            # Another replica's wall clock: one running ahead must not hold the window
            # shut for longer than a minute from now.
            w, n = round(min(float(e[0]), wall_now), 3), e[1]
            if (w, n) not in have and wall_now - w < 60.0:
                merged.append((now - (wall_now - w), n))
        self._done = deque(sorted(merged))


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
        self.cluster = ClusterState(cfg.labels.prefix, wall=wall)
        self.product_label = self.cluster.product_label
        self.gpus_key = cfg.labels.prefix + GPUS_ANNOTATION
        self.selector = selector_matcher(self.rb.selector)
        self._lock = threading.Lock()
        self.nodes: dict[str, NodeFacts] = {}
        self.gpu_states: dict[str, list[GpuState]] = {}
        self.running: dict[str, PodFacts] = {}  # by "ns/name"
        self.pending: dict[str, PodFacts] = {}  # by UID
        self._unhealthy_since: dict[tuple[str, str], float] = {}  # (node, GPU uuid) -> wall
        self._told: dict[tuple[str, str], float] = {}  # (pod uid, reason) -> last Event
        self._made_room_for: dict[str, float] = {}  # pending UID -> when its plan ran
        # The room kept for pending pods, by pod UID: written on the Lease (the only
        # place the extender reads it), dropped when the pod binds or goes, when it
        # runs out, and when this replica stops leading.
        self.reservations: dict[str, Reservation] = {}
        self._room_tries: dict[str, int] = {}  # pending UID -> plans run for it
        self.namespaces = frozenset(self.rb.namespaces)  # empty: every namespace
        self.limits = RateLimit(
            self.rb.max_evictions_per_minute, self.rb.max_evictions_per_node, clock
        )
        self.elector = LeaderElector(
            client, cfg.kubernetes.lease_namespace, LEASE_NAME, identity,
            self.rb.lease_duration_s, wall=wall, clock=clock,
            state_key=STATE_ANNOTATION, save=self._save_state, load=self._load_state,
            annotations=self._lease_annotations,
        )  # fmt: skip
        cap = cfg.kubernetes.backoff_max_seconds
        c = self.cluster
        self.reflectors = [
            Reflector(client, "nodes", "/api/v1/nodes", self._nodes_replace, self._node_event,
                      backoff=Backoff(0.5, cap)),
            Reflector(client, "pods", "/api/v1/pods", self._pods_replace, self._pod_event,
                      query={"fieldSelector": POD_SELECTOR}, backoff=Backoff(0.5, cap)),
            Reflector(client, "leases", lease_path(cfg.kubernetes.lease_namespace),
                      c.replace_leases, c.lease_event, backoff=Backoff(0.5, cap)),
            Reflector(client, "pending", "/api/v1/pods", self._pending_replace,
                      self._pending_event, backoff=Backoff(0.5, cap),
                      query={"fieldSelector": pending_selector(self.rb.scheduler_name)}),
        ]  # fmt: skip
        self.registry.register(BadDataCollector(
            "rebalancer", self.cluster.bad_counts,
            lambda: {r.kind: r.handler_errors for r in self.reflectors},
        ))  # fmt: skip
        self.server = HttpServer(self.rb.listen, self._wsgi, name="rebalance", threads=2)
        self.stop_event = threading.Event()

    # -- caches -------------------------------------------------------------------

    def _nodes_replace(self, items: list[dict[str, Any]]) -> None:
        self.cluster.replace_nodes(items)
        with self._lock:
            self.nodes.clear()
            self.gpu_states.clear()
            for obj in items:
                self._put_node(obj)

    def _node_event(self, kind: str, obj: dict[str, Any]) -> None:
        self.cluster.node_event(kind, obj)
        name = str((obj.get("metadata") or {}).get("name", ""))
        with self._lock:
            if kind == "DELETED":
                self.nodes.pop(name, None)
                self.gpu_states.pop(name, None)
            else:
                self._put_node(obj)

    def _put_node(self, obj: Mapping[str, Any]) -> None:
        """A node whose agent data cannot be read (the cluster state has logged and
        counted it) gets no facts: nothing is drained from it or moved onto it."""
        meta = obj.get("metadata") or {}
        name = str(meta.get("name", ""))
        self.nodes.pop(name, None)
        self.gpu_states.pop(name, None)
        if self.cluster.bad_reason(name):
            return
        try:
            gpus = decode_gpus((meta.get("annotations") or {}).get(self.gpus_key) or "[]")
            facts = node_facts(obj)
        except (BadValueError, AttributeError, TypeError):
            return
        self.nodes[name], self.gpu_states[name] = facts, gpus

    def _parse(self, obj: Mapping[str, Any]) -> PodFacts | None:
        return pod_facts(obj, self.product_label, self.selector)

    def _pods_replace(self, items: list[dict[str, Any]]) -> None:
        self.cluster.replace_pods(items)
        with self._lock:
            self.running = {p.key: p for o in items if (p := self._parse(o)) is not None}

    def _pod_event(self, kind: str, obj: dict[str, Any]) -> None:
        self.cluster.pod_event(kind, obj)
        meta = obj.get("metadata") or {}
        key = f"{meta.get('namespace')}/{meta.get('name')}"
        phase = (obj.get("status") or {}).get("phase")
        with self._lock:
            pod = (
                None if kind == "DELETED" or phase in ("Succeeded", "Failed") else self._parse(obj)
            )
            if pod is None or not pod.node:
                self.running.pop(key, None)
            else:
                self.running[key] = pod

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
        return all(r.synced.is_set() for r in self.reflectors)

    # -- state kept on the Lease -----------------------------------------------------

    def _save_state(self) -> str:
        sick = sorted(self._unhealthy_since.items(), key=lambda kv: kv[1])
        return json.dumps(
            {
                "evictions": self.limits.export(self.wall()),
                "unhealthy_since": {
                    f"{n}/{u}": round(t, 3) for (n, u), t in sick[:MAX_SAVED_SICK_GPUS]
                },
            },
            separators=(",", ":"),
        )

    def _load_state(self, text: str) -> None:
        if not text:
            return
        try:
            data = json.loads(text)
            if not isinstance(data, dict):
                raise ValueError("not an object")
        except ValueError as e:
            logger.warning("rebalancer: ignoring unreadable {} on the Lease: {}",
                           STATE_ANNOTATION, e)  # fmt: skip
            return
        evictions = data.get("evictions")
        self.limits.load(evictions if isinstance(evictions, list) else [], self.wall())
        since = data.get("unhealthy_since")
        for key, t in since.items() if isinstance(since, dict) else []:
            node, _, uuid = str(key).partition("/")
            if uuid and isinstance(t, int | float):
                k, t = (node, uuid), min(float(t), self.wall())  # not from the future
                self._unhealthy_since[k] = min(t, self._unhealthy_since.get(k, t))
        logger.info("rebalancer: carried on from the Lease: {} evictions in the last minute, "
                    "{} unhealthy GPUs' grace clocks", len(self.limits.export(self.wall())),
                    len(self._unhealthy_since))  # fmt: skip

    def _live_reservations(self) -> list[Reservation]:
        """Drop the reservations whose pod is bound or gone, or whose time ran out."""
        now = self.wall()
        with self._lock:
            self.reservations = {
                u: r for u, r in self.reservations.items() if r.until > now and u in self.pending
            }
            return sorted(self.reservations.values(), key=lambda r: r.until)

    def _lease_annotations(self) -> dict[str, str]:
        """Written with every Lease write: the reservations the extender honours."""
        return {RESERVATIONS_ANNOTATION: encode(self._live_reservations())}

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

    def _pass(self) -> None:
        with self._lock:
            nodes = dict(self.nodes)
            gpu_states = {n: list(g) for n, g in self.gpu_states.items()}
            running = dict(self.running)
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
        now = self.wall()
        sick, seen = [], set()
        for node, gpus in gpu_states.items():
            for g in gpus:
                if g.healthy:
                    continue
                key = (node, g.uuid)
                seen.add(key)
                since = self._unhealthy_since.setdefault(key, now)
                sick.append((node, g.index, g.reason or "unhealthy", now - since, g.pods))
        for key in set(self._unhealthy_since) - seen:
            del self._unhealthy_since[key]  # healthy again, or gone: the grace starts over
        blocked = 0
        for d in drain(sick, running, fresh, self.rb.grace_s):
            if not d.evict:
                blocked += 1
                if self._event(d.pod, "RebalanceSkipped", d.message, warning=True, dedupe=d.reason):
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
                self._event(pod, "RebalanceSkipped", f"room for it on {plan.node} needs "
                            f"{len(plan.victims)} evictions ({victims}); over the rate limit now",
                            warning=True, dedupe="rate_limited")  # fmt: skip
                return len(plan.victims)
            refused = [(v, r) for v in plan.victims if (r := self._eviction_refused(v))]
            if refused:
                who, why = refused[0]
                self.metrics.skipped.labels("defrag", why).inc()
                what = "a PodDisruptionBudget protects" if why == "refused_pdb" else "cannot evict"
                msg = f"room for it on {plan.node} needs evicting {victims}; {what} {who.key}"
                self._event(pod, "RebalanceSkipped", msg, warning=True, dedupe=why)
                return len(plan.victims)
            if not self.rb.dry_run and not self._reserve(pod, plan.node):
                self.metrics.skipped.labels("defrag", "max_reservations").inc()
                return len(plan.victims)
            if not self.rb.dry_run and not self._commit(plan.node, len(plan.victims)):
                self.reservations.pop(pod.uid, None)
                return len(plan.victims)  # lost the Lease: the new leader decides
            if not self.rb.dry_run:
                self._mirror(pod, plan.node)
            verb = "would make" if self.rb.dry_run else "making"
            where = ", ".join(plan.targets)
            msg = f"{verb} room on {plan.node} by evicting {victims} (each fits now on: {where})"
            self._event(pod, "RebalanceDefragment", msg)
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
            if self._event(pod, "RebalanceSkipped", message, warning=True, dedupe=reason):
                self.metrics.skipped.labels("defrag", reason).inc()
            return
        key, last = (pod.uid, reason), self._told.get((pod.uid, reason))
        if last is None or self.clock() - last >= EVENT_REPEAT_S:
            self._told[key] = self.clock()
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
        now = self.clock()  # an Event's dedupe entry is of no use past EVENT_REPEAT_S
        self._told = {k: t for k, t in self._told.items() if now - t < EVENT_REPEAT_S}

    # -- acting ---------------------------------------------------------------------

    def _eviction_path(self, pod: PodFacts) -> str:
        return f"/api/v1/namespaces/{pod.namespace}/pods/{pod.name}/eviction"

    def _eviction_body(self, pod: PodFacts) -> dict[str, Any]:
        return {"apiVersion": "policy/v1", "kind": "Eviction",
                "metadata": {"name": pod.name, "namespace": pod.namespace}}  # fmt: skip

    def _reserve(self, pod: PodFacts, node: str) -> bool:
        """Keep the room made on `node` for the pending pod (the evicted pods'
        replacements would otherwise take it back: spreading replicas scores the emptied
        node best). Only in memory here: `_commit` writes it on the Lease before any
        eviction. False: `max_reservations` are live, do not evict."""
        live = self._live_reservations()
        if pod.uid not in self.reservations and len(live) >= self.rb.max_reservations:
            logger.info("rebalancer: not making room for {}: {} reservations live already",
                        pod.key, len(live))  # fmt: skip
            return False
        until = self.wall() + min(float(self.rb.reserve_s), MAX_RESERVE_S)
        self.reservations[pod.uid] = Reservation(
            pod.uid, pod.key, node, pod.shape.gpus, pod.priority, until
        )
        return True

    def _mirror(self, pod: PodFacts, node: str) -> None:
        """The reservation on the pod too, for people (`kubectl describe`); nothing
        reads it back, and a failure to write it changes nothing."""
        r = self.reservations.get(pod.uid)
        if r is None:
            return
        ann = {RESERVED_NODE_ANNOTATION: node, RESERVED_UNTIL_ANNOTATION: f"{r.until:.0f}"}
        body = {"metadata": {"annotations": ann}}
        try:
            self.kube.request("PATCH", f"/api/v1/namespaces/{pod.namespace}/pods/{pod.name}",
                              body, content_type="application/merge-patch+json")  # fmt: skip
        except KubeError as e:
            logger.debug("rebalancer: reservation note on {}: {}", pod.key, e)

    def _eviction_refused(self, pod: PodFacts) -> str:
        """The Eviction API's own answer, without evicting (dryRun=All): "" when it would
        go ahead, "refused_pdb" for a PodDisruptionBudget, "api_error" otherwise."""
        try:
            self.kube.request(
                "POST", self._eviction_path(pod), self._eviction_body(pod), query={"dryRun": "All"}
            )
            return ""
        except KubeNotFoundError:
            return "api_error"  # gone since the snapshot: plan again next pass
        except KubeError as e:
            if e.status == 429:
                return "refused_pdb"
            logger.warning("rebalancer: eviction check for {}: {}", pod.key, e)
            return "api_error"

    def _evict(self, d: Decision, allowed: bool, committed: bool = False) -> bool:
        """Evict (or, dry-run, say it would); True when done or planned. `committed`:
        already written into the Lease's rate-limit window by the caller."""
        pod = d.pod
        if self.rb.dry_run:
            msg = f"dry run: would evict: {d.message}"
            if self._event(pod, "RebalanceWouldEvict", msg, dedupe="would"):
                self.metrics.evictions.labels(d.kind, "planned").inc()  # once per pod
                logger.info("rebalancer (dry run): would evict {}: {}", pod.key, d.message)
            return True
        if not allowed:
            self.metrics.skipped.labels(d.kind, "rate_limited").inc()
            self._event(pod, "RebalanceSkipped", f"{d.message}; over the rate limit now, later",
                        warning=True, dedupe="rate_limited")  # fmt: skip
            return False
        if not committed and not self._commit(pod.node, 1):
            return False  # lost the Lease during the pass: the new leader decides
        try:
            self.kube.request("POST", self._eviction_path(pod), self._eviction_body(pod))
        except KubeNotFoundError:
            self.limits.forget(pod.node)
            return True  # gone already
        except KubeError as e:
            self.limits.forget(pod.node)  # not evicted: it does not count
            if e.status == 429:
                self.metrics.evictions.labels(d.kind, "refused_pdb").inc()
                msg = f"{d.message}; a PodDisruptionBudget does not allow it now, retried later"
                self._event(pod, "RebalanceRefused", msg, warning=True, dedupe="pdb")
            else:
                self.metrics.evictions.labels(d.kind, "failed").inc()
                logger.warning("rebalancer: evicting {} failed: {}", pod.key, e)
            return False
        self.metrics.evictions.labels(d.kind, "done").inc()
        logger.info("rebalancer: evicted {}: {}", pod.key, d.message)
        self._event(pod, "RebalanceEvicted", d.message)
        return True

    def _event(
        self, pod: PodFacts, reason: str, message: str, *, warning: bool = False, dedupe: str = ""
    ) -> bool:
        """An Event on the pod; the same (pod, dedupe key) at most every EVENT_REPEAT_S.
        False when this one was held back as a repeat."""
        if dedupe:
            key = (pod.uid, dedupe)
            last = self._told.get(key)
            if last is not None and self.clock() - last < EVENT_REPEAT_S:
                return False
            self._told[key] = self.clock()
        now = micro_time(self.wall())[:19] + "Z"
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{pod.name}.", "namespace": pod.namespace},
            "involvedObject": {"apiVersion": "v1", "kind": "Pod", "namespace": pod.namespace,
                               "name": pod.name, "uid": pod.uid},
            "reason": reason,
            "message": message[:1024],
            "type": "Warning" if warning else "Normal",
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT,
            "reportingInstance": self.identity,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }  # fmt: skip
        try:
            self.kube.request("POST", f"/api/v1/namespaces/{pod.namespace}/events", body)
        except KubeError as e:
            logger.debug("rebalancer: event for {}: {}", pod.key, e)
        return True

    # -- running ----------------------------------------------------------------------

    def _wsgi(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path == "/metrics":
            data = generate_latest(self.registry)
            start_response("200 OK", [("Content-Type", "text/plain; version=0.0.4"),
                                      ("Content-Length", str(len(data)))])  # fmt: skip
            return [data]
        probe = probe_response(path, self.ready, start_response)
        if probe is not None:
            return probe
        return text_response(
            start_response, "404 Not Found", "not found: try /metrics, /healthz, /readyz\n"
        )

    def ready(self) -> tuple[bool, str]:
        waiting = [r.kind for r in self.reflectors if not r.synced.is_set()]
        if waiting:
            return False, "waiting for the first list of: " + ", ".join(waiting)
        return True, "ok"

    def start(self) -> None:
        self.server.start()  # a bad listen address exits 2 before any API call
        for r in self.reflectors:
            threading.Thread(target=r.run, args=(self.stop_event,), name=f"watch-{r.kind}",
                             daemon=True).start()  # fmt: skip
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
        self.server.stop()
