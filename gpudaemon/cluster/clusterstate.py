"""The extender's view of the cluster: one `NodeState` per node, kept current by the
informers' handlers and by provisional placements ("assumed" pods, `AssumeCache`). A
request reads it through `snapshot`: every named node's state and freshness as of one
moment.

Free GPUs on a node = allocatable `nvidia.com/gpu` - requests of the non-terminal pods
bound there - GPUs assumed for pods this extender ranked but has not yet seen bound.
MIG devices (the device plugin's mixed strategy) are counted the same way, per profile
resource `nvidia.com/mig-<profile>`.

Why assume: the scheduler binds asynchronously and the pod watch lags by tens of ms, so
in a burst several pods would be scored from the same stale count and pile onto the
node that looked best. When prioritize ranks a node first for a pod, that pod's
requests are counted on that node (keyed by pod UID) until the watch shows the pod
bound (the real binding replaces the assumption, wherever it landed), the pod goes
away, or `assume_ttl_s` passes (the scheduler chose a node we ranked lower and the
pod is gone before we saw it, or it stayed pending).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from loguru import logger

from gpudaemon.cluster.podspec import (
    GPU_RESOURCE,
    MIG_RESOURCE_PREFIX,
    pod_gang,
    pod_shape,
    quantity,
)
from gpudaemon.cluster.state import MigCounts, NodeState, PodShape, add_mig
from gpudaemon.errors import BadValueError
from gpudaemon.kube.lease import lease_expiry
from gpudaemon.labels.annotations import count_label, decode_gpus
from gpudaemon.labels.keys import (
    GPU_COUNT,
    GPU_HEALTHY,
    GPU_PRODUCT,
    GPU_UNHEALTHY,
    GPUS_ANNOTATION,
)
from gpudaemon.labels.sanitize import DEFAULT_PREFIX

Obj = Mapping[str, Any]
TERMINAL_PHASES = ("Succeeded", "Failed")
_NEVER = float("-inf")  # fresh until: no Lease vouches for the node


@dataclass(frozen=True, slots=True)
class Snapshot:
    states: dict[str, NodeState | None]
    fresh: dict[str, bool]


class NodeListener(Protocol):
    def observe_node(self, node: NodeState) -> None: ...

    def forget_node(self, name: str) -> None: ...


@dataclass(frozen=True, slots=True)
class _Pod:
    node: str
    shape: PodShape
    gang: str = ""


@dataclass(frozen=True, slots=True)
class _Assumed:
    node: str
    shape: PodShape
    expires_at: float
    gang: str = ""
    assumed_wall: float = 0.0  # wall-clock time of the assumption


def _expiry(lease: Obj) -> tuple[float | None, str]:
    """(wall-clock expiry, owner Node UID) of a Lease. The expiry is the agent's own rule
    (`lease_expiry`, which `lease_is_fresh` applies), taken once per event rather than
    once per node per request."""
    owners = (lease.get("metadata") or {}).get("ownerReferences") or []
    owner = next((str(o.get("uid", "")) for o in owners if o.get("kind") == "Node"), "")
    expiry = lease_expiry(lease)
    return (None if expiry is None else expiry.timestamp()), owner


class AssumeCache:
    """Pods counted on a node before the watch shows their binding, by pod UID, each
    until a deadline (kube-scheduler's assume cache). Not locked: ClusterState, which
    adds their requests to the nodes' usage, holds its lock around every call."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._by_uid: dict[str, _Assumed] = {}

    def add(
        self,
        uid: str,
        node: str,
        shape: PodShape,
        now: float,
        ttl_s: float | None = None,
        gang: str = "",
        wall: float = 0.0,
    ) -> _Assumed | None:
        """Assume `uid` on `node`; returns the assumption it replaces, if any."""
        old = self._by_uid.pop(uid, None)
        self._by_uid[uid] = _Assumed(node, shape, now + (ttl_s or self.ttl_s), gang, wall)
        return old

    def get(self, uid: str) -> _Assumed | None:
        return self._by_uid.get(uid)

    def pop(self, uid: str) -> _Assumed | None:
        return self._by_uid.pop(uid, None)

    def expire(self, now: float) -> list[_Assumed]:
        """Remove and return the assumptions whose deadline has passed."""
        gone = [u for u, a in self._by_uid.items() if a.expires_at <= now]
        return [self._by_uid.pop(u) for u in gone]

    def __len__(self) -> int:
        return len(self._by_uid)


class ClusterState:
    """Thread-safe store fed by the Node, Pod and Lease informers."""

    def __init__(
        self,
        prefix: str = DEFAULT_PREFIX,
        *,
        assume_ttl_s: float = 30.0,
        gang_assume_ttl_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.prefix = prefix
        self.product_label = prefix + GPU_PRODUCT
        self.assume_ttl_s = assume_ttl_s
        # A gang's pods wait at Coscheduling's Permit, unbound, until the whole gang has
        # nodes (up to its scheduleTimeoutSeconds): their GPUs stay counted that long.
        self.gang_assume_ttl_s = max(assume_ttl_s, gang_assume_ttl_s)
        self.clock, self.wall = clock, wall
        self._lock = threading.RLock()
        self._nodes: dict[str, NodeState] = {}  # without pod usage
        self._node_uids: dict[str, str] = {}
        self._pods: dict[str, _Pod] = {}  # by UID, bound and non-terminal only
        # node -> (gpus, cpu m, mem B, MIG devices by profile), bound and assumed pods
        self._usage: dict[str, tuple[int, int, int, MigCounts]] = {}
        # node -> (gpus, MIG devices) of the assumed pods alone (part of _usage)
        self._assumed_usage: dict[str, tuple[int, MigCounts]] = {}
        self._assumed = AssumeCache(assume_ttl_s)
        self._gangs: dict[str, dict[str, int]] = {}  # gang -> node -> its pods there
        self._leases: dict[str, tuple[float | None, str]] = {}  # node -> (expiry, owner)
        # node -> wall-clock time its agent data goes stale: the Lease's expiry when the
        # Lease vouches for this Node object, else absent. Kept at event time so a
        # request compares one number per node.
        self._fresh_until: dict[str, float] = {}
        self._states: dict[str, NodeState] = {}  # cache of node + usage, per node
        # Told of every node as it appears or changes (without pod usage) and as it goes:
        # the policies' `observe_node` / `forget_node` hooks, off the request path.
        self._node_listeners: list[NodeListener] = []
        # node -> why its agent data is unreadable (never fresh while it is listed), and
        # (key, value) last logged for it, so a value is logged and counted once.
        self._bad: dict[str, str] = {}
        self._bad_seen: dict[str, tuple[str, int]] = {}
        self.bad_values: dict[str, int] = {}  # key -> unreadable values seen

    def add_node_listener(self, listener: NodeListener) -> None:
        """Also replays the nodes already known, so the order of wiring does not matter."""
        with self._lock:
            if any(x is listener for x in self._node_listeners):
                return
            self._node_listeners.append(listener)
            for st in self._nodes.values():
                listener.observe_node(st)

    # -- nodes --------------------------------------------------------------------

    def replace_nodes(self, items: Iterable[Obj]) -> None:
        with self._lock:
            gone = set(self._nodes)
            self._nodes.clear()
            self._node_uids.clear()
            self._states.clear()
            self._bad.clear()
            for obj in items:
                self._put_node(obj)
            for name in gone - set(self._nodes):
                for listener in self._node_listeners:
                    listener.forget_node(name)
            for name in set(self._bad_seen) - set(self._nodes):
                self._bad_seen.pop(name, None)
            self._fresh_until = {n: t for n in self._leases if (t := self._vouch(n)) is not None}

    def node_event(self, kind: str, obj: Obj) -> None:
        name = str((obj.get("metadata") or {}).get("name", ""))
        with self._lock:
            if kind == "DELETED":
                self._nodes.pop(name, None)
                self._node_uids.pop(name, None)
                self._states.pop(name, None)
                self._bad.pop(name, None)
                self._bad_seen.pop(name, None)
                for listener in self._node_listeners:
                    listener.forget_node(name)
            else:
                self._put_node(obj)
            self._update_fresh(name)

    def _put_node(self, obj: Obj) -> None:
        """Never raises: a Node whose agent values (or whose object) cannot be read is
        kept as a node with no data (`bad_data`), counted and logged once."""
        try:
            meta = obj.get("metadata") or {}
            name = str(meta.get("name", ""))
        except Exception:  # not an object at all: nothing to key it by
            self._note_bad("", "node", None, "not a Node object")
            return
        try:
            st = self._read_node(name, meta, obj)
        except BadValueError as e:
            st = self._read_node(name, meta, obj, agent=False, bad=str(e))
            self._note_bad(name, e.key, self._agent_values_id(meta), e.reason)
        except Exception as e:  # a shape the API server would not store: a bug or a fake
            st = NodeState(name=name, has_agent_labels=False, bad_data="unreadable Node object")
            self._note_bad(name, "node", None, f"unreadable Node object ({type(e).__name__})")
        else:
            self._note_good(name)
        self._nodes[name] = st
        self._node_uids[name] = str(meta.get("uid", ""))
        self._states.pop(name, None)
        for listener in self._node_listeners:
            listener.observe_node(st)

    def _read_node(
        self, name: str, meta: Obj, obj: Obj, *, agent: bool = True, bad: str = ""
    ) -> NodeState:
        """The node's state; BadValueError when an agent-written value is unreadable.
        With `agent` False (after one was), the Node's own figures alone, as no data."""
        labels = meta.get("labels") or {}
        alloc = (obj.get("status") or {}).get("allocatable") or {}
        p = self.prefix
        has_agent = (p + GPU_COUNT) in labels
        count = healthy = unhealthy = 0
        utilization = None
        if agent and has_agent:
            count = count_label(labels[p + GPU_COUNT], GPU_COUNT)
            healthy = _count(labels, p + GPU_HEALTHY, count)
            # `gpu.unhealthy` counts physical GPUs; under the single MIG strategy
            # `gpu.count` counts MIG devices, so count - healthy would be wrong there.
            unhealthy = _count(labels, p + GPU_UNHEALTHY, max(0, count - healthy))
        if agent:
            utilization = _mean_utilization(
                (meta.get("annotations") or {}).get(p + GPUS_ANNOTATION)
            )
        mig = tuple(
            sorted(
                (k.removeprefix(MIG_RESOURCE_PREFIX), n)
                for k, v in alloc.items()
                if isinstance(k, str)
                and k.startswith(MIG_RESOURCE_PREFIX)
                and (n := int(_q(v))) > 0
            )
        )
        return NodeState(
            name=name,
            gpu_model=str(labels.get(self.product_label, "")),
            gpus_allocatable=int(_q(alloc.get(GPU_RESOURCE))),
            gpus_unhealthy=max(0, unhealthy),
            mig_allocatable=mig,
            cpu_allocatable_milli=int(_q(alloc.get("cpu")) * 1000),
            memory_allocatable_bytes=int(_q(alloc.get("memory"))),
            utilization_ratio=utilization,
            has_agent_labels=has_agent,
            gpus_total=count,
            bad_data=bad,
        )

    # -- values a node wrote that could not be read -------------------------------------

    def _agent_values_id(self, meta: Obj) -> int:
        """One number for the agent's values on the Node, to tell a new bad value from
        the same one sent again (no repr: that could recurse)."""
        labels, ann = meta.get("labels") or {}, meta.get("annotations") or {}
        p = self.prefix
        values = [labels.get(p + k) for k in _COUNT_LABELS] + [ann.get(p + GPUS_ANNOTATION)]
        return hash(tuple(v if isinstance(v, str) else type(v).__name__ for v in values))

    def _note_bad(self, name: str, key: str, value_id: int | None, reason: str) -> None:
        """The node has no data until it writes a readable value. Logged and counted
        once per node and value, not per event: a node's Lease renewals and label
        writes re-send the same bad value every few minutes."""
        self._bad[name] = f"{key}: {reason}"
        self._fresh_until.pop(name, None)
        seen = (key, value_id if value_id is not None else hash(reason))
        if self._bad_seen.get(name) == seen:
            return
        self._bad_seen[name] = seen
        self.bad_values[key] = self.bad_values.get(key, 0) + 1
        logger.warning(
            "node {}: ignoring its {} ({}); the node has no agent data until it writes a"
            " readable value",
            name or "(unnamed)", key, reason,
        )  # fmt: skip

    def _note_good(self, name: str) -> None:
        self._bad.pop(name, None)
        if self._bad_seen.pop(name, None) is not None:
            logger.info("node {}: its agent data is readable again", name)

    def bad_reason(self, name: str) -> str:
        """Why the node's agent data could not be read; "" when it could."""
        with self._lock:
            return self._bad.get(name, "")

    def bad_counts(self) -> dict[str, int]:
        """Unreadable values seen, by key (once per node and value): for the metric."""
        with self._lock:
            return dict(self.bad_values)

    # -- pods ---------------------------------------------------------------------

    def replace_pods(self, items: Iterable[Obj]) -> None:
        with self._lock:
            for uid in list(self._pods):
                self._drop_pod(uid)
            self._states.clear()
            for obj in items:
                self._put_pod(obj)

    def pod_event(self, kind: str, obj: Obj) -> None:
        with self._lock:
            if kind == "DELETED":
                uid = str((obj.get("metadata") or {}).get("uid", ""))
                self._drop_pod(uid)
                self._drop_assumed(uid)
            else:
                self._put_pod(obj)

    def _put_pod(self, obj: Obj) -> None:
        meta = obj.get("metadata") or {}
        uid = str(meta.get("uid", ""))
        node = str((obj.get("spec") or {}).get("nodeName") or "")
        phase = (obj.get("status") or {}).get("phase")
        self._drop_pod(uid)
        if not node:
            return
        self._drop_assumed(uid)  # bound: the real placement replaces the assumption
        if phase in TERMINAL_PHASES:
            return
        try:
            shape = pod_shape(obj, self.product_label)
        except (ValueError, AttributeError, TypeError):  # a quantity we cannot read
            return
        gang = pod_gang(obj)
        self._pods[uid] = _Pod(node, shape, gang)
        self._add_usage(node, shape, +1)
        self._add_gang(gang, node, +1)

    def _drop_pod(self, uid: str) -> None:
        old = self._pods.pop(uid, None)
        if old is not None:
            self._add_usage(old.node, old.shape, -1)
            self._add_gang(old.gang, old.node, -1)

    def _add_gang(self, gang: str, node: str, sign: int) -> None:
        if not gang:
            return
        nodes = self._gangs.setdefault(gang, {})
        n = nodes.get(node, 0) + sign
        if n > 0:
            nodes[node] = n
        else:
            nodes.pop(node, None)
            if not nodes:
                self._gangs.pop(gang, None)

    def gang_nodes(self, gang: str) -> dict[str, int]:
        """Nodes holding the gang's pods (bound or assumed), with how many each."""
        with self._lock:
            if self._assumed:
                self._expire_assumed()
            return dict(self._gangs.get(gang, {}))

    def _add_usage(self, node: str, s: PodShape, sign: int) -> None:
        g, c, m, mig = self._usage.get(node, (0, 0, 0, ()))
        g, c, m = g + sign * s.gpus, c + sign * s.cpu_milli, m + sign * s.memory_bytes
        if s.mig:
            mig = add_mig(mig, s.mig, sign)
        if (g, c, m, mig) == (0, 0, 0, ()):
            self._usage.pop(node, None)
        else:
            self._usage[node] = (g, c, m, mig)
        self._states.pop(node, None)

    # -- leases -------------------------------------------------------------------

    def replace_leases(self, items: Iterable[Obj]) -> None:
        with self._lock:
            self._leases.clear()
            self._fresh_until.clear()
            for obj in items:
                self.lease_event("ADDED", obj)

    def lease_event(self, kind: str, obj: Obj) -> None:
        name = str((obj.get("metadata") or {}).get("name", ""))
        with self._lock:
            if kind == "DELETED":
                self._leases.pop(name, None)
            else:
                self._leases[name] = _expiry(obj)
            self._update_fresh(name)

    def _vouch(self, name: str) -> float | None:
        """The Lease's expiry if it vouches for the current Node object: a Lease left
        from a deleted Node of the same name vouches for nothing."""
        expiry, owner = self._leases.get(name, (None, ""))
        uid = self._node_uids.get(name, "")
        if expiry is None or (owner and uid and owner != uid) or name in self._bad:
            return None
        return expiry

    def _update_fresh(self, name: str) -> None:
        until = self._vouch(name)
        if until is None:
            self._fresh_until.pop(name, None)
        else:
            self._fresh_until[name] = until

    def fresh(self, name: str) -> bool:
        """The agent's Lease is unexpired and owned by this Node object."""
        return self.freshness([name])[name]

    def is_bound(self, uid: str) -> bool:
        with self._lock:
            return uid in self._pods

    # -- assumptions --------------------------------------------------------------

    def assume(self, pod_uid: str, node: str, shape: PodShape, gang: str = "") -> None:
        """Count the pod on `node` until the watch reports where it really went."""
        if not pod_uid or not shape.wants_gpus:
            return
        with self._lock:
            if pod_uid in self._pods:  # already bound: nothing to assume
                return
            ttl = self.gang_assume_ttl_s if gang else self.assume_ttl_s
            old = self._assumed.add(pod_uid, node, shape, self.clock(), ttl, gang, self.wall())
            if old is not None:
                self._unassume_usage(old)
            self._add_usage(node, shape, +1)
            self._add_assumed(node, shape, +1)
            self._add_gang(gang, node, +1)

    def _add_assumed(self, node: str, s: PodShape, sign: int) -> None:
        g, mig = self._assumed_usage.get(node, (0, ()))
        g += sign * s.gpus
        if s.mig:
            mig = add_mig(mig, s.mig, sign)
        if (g, mig) == (0, ()):
            self._assumed_usage.pop(node, None)
        else:
            self._assumed_usage[node] = (g, mig)

    def _unassume_usage(self, a: _Assumed) -> None:
        self._add_usage(a.node, a.shape, -1)
        self._add_assumed(a.node, a.shape, -1)
        self._add_gang(a.gang, a.node, -1)

    def unassume_if_failed_since(self, pod_uid: str, failed_at: float) -> None:
        """The scheduler reported the pod unschedulable at wall time `failed_at` (its
        PodScheduled=False condition): an assumption made before then is void."""
        with self._lock:
            a = self._assumed.get(pod_uid)
            if a is not None and failed_at >= math.floor(a.assumed_wall):
                self._drop_assumed(pod_uid)

    def is_assumed(self, pod_uid: str) -> bool:
        with self._lock:
            return self._assumed.get(pod_uid) is not None

    def unassume(self, pod_uid: str) -> None:
        """The scheduler is trying the pod again, so its last placement did not happen
        (a gang that timed out at Permit, a bind that failed): stop counting it."""
        with self._lock:
            self._drop_assumed(pod_uid)

    def _drop_assumed(self, uid: str) -> None:
        a = self._assumed.pop(uid)
        if a is not None:
            self._unassume_usage(a)

    def _expire_assumed(self) -> None:
        for a in self._assumed.expire(self.clock()):
            self._unassume_usage(a)

    # -- reads --------------------------------------------------------------------

    def states(self, names: Iterable[str]) -> dict[str, NodeState | None]:
        """Current state of each named node (None: not in the cache)."""
        with self._lock:
            if self._assumed:
                self._expire_assumed()
            out: dict[str, NodeState | None] = {}
            for name in names:
                st = self._states.get(name)
                if st is None:
                    base = self._nodes.get(name)
                    if base is not None:
                        g, c, m, mig = self._usage.get(name, (0, 0, 0, ()))
                        ag, amig = self._assumed_usage.get(name, (0, ()))
                        st = replace(
                            base,
                            gpus_requested=g,
                            cpu_requested_milli=c,
                            memory_requested_bytes=m,
                            mig_requested=mig,
                            gpus_assumed=ag,
                            mig_assumed=amig,
                        )
                        self._states[name] = st
                out[name] = st
            return out

    def snapshot(self, names: Sequence[str]) -> Snapshot:
        """The named nodes' states and freshness as of one moment, under one lock, so a
        request judges one consistent cluster (not states from before an event and
        freshness from after it)."""
        with self._lock:
            return Snapshot(self.states(names), self.freshness(names))

    def freshness(self, names: Iterable[str]) -> dict[str, bool]:
        """`fresh` for many nodes under one lock (the per-request path)."""
        now = self.wall()
        with self._lock:
            get = self._fresh_until.get
            return {n: now < get(n, _NEVER) for n in names}

    def gpu_node_names(self) -> list[str]:
        """Nodes with GPUs: an agent labelled them or they have nvidia.com/gpu."""
        with self._lock:
            return sorted(
                n
                for n, st in self._nodes.items()
                if st.has_agent_labels or st.gpus_allocatable or st.mig_allocatable
            )

    def sizes(self) -> dict[str, int]:
        with self._lock:
            return {
                "nodes": len(self._nodes),
                "pods": len(self._pods),
                "leases": len(self._leases),
                "assumed": len(self._assumed),
            }


_MAX_QUANTITY = float(2**62)  # beyond any node; keeps `* 1000` and int() finite


def _q(v: object) -> float:
    """An allocatable quantity (kubelet writes them); unreadable or absurd reads as 0."""
    if v is None:
        return 0.0
    try:
        q = quantity(v)
    except ValueError:
        return 0.0
    return q if 0.0 <= q <= _MAX_QUANTITY else 0.0


_COUNT_LABELS = (GPU_COUNT, GPU_HEALTHY, GPU_UNHEALTHY)


def _count(labels: Obj, key: str, default: int) -> int:
    """An optional count label; absent is `default`, unreadable is BadValueError."""
    v = labels.get(key)
    return default if v is None else count_label(v, key.rpartition("/")[2])


def _mean_utilization(annotation: object) -> float | None:
    """Mean `utilization_pct` of the agent's `gpus` annotation, as a ratio (read with
    the annotation's own bounded decoder, next to its encoder). Absent: None;
    unreadable: BadValueError."""
    if annotation is None:
        return None
    gpus = decode_gpus(annotation)
    vals = [g.utilization_pct for g in gpus if g.utilization_pct is not None]
    return sum(vals) / len(vals) / 100.0 if vals else None
