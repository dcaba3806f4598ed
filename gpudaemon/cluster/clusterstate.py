"""The programs' view of the cluster: one `NodeState` per node, kept current by the
informers' handlers and by provisional placements ("assumed" pods, `assume.py`). A
request reads it through `snapshot`: every named node's state and freshness as of one
moment. One store per resource, shared by every consumer (client-go's rule): a program
that needs more of a Node or a pod than `NodeState` holds registers a `node_view` or
`pod_view`, kept here beside the store's own, instead of a mirror cache of its own.

Free GPUs on a node = allocatable `nvidia.com/gpu` - requests of the non-terminal pods
bound there - GPUs assumed for pods this extender ranked but has not yet seen bound.
MIG devices (the device plugin's mixed strategy) are counted the same way, per profile
resource `nvidia.com/mig-<profile>`.

With DRA on, a node's NVIDIA devices in ResourceSlices add to its allocatable (less
tainted free ones: drastate.fold), devices allocated to claims to its requested, and a
pod's unallocated claims to its shape: every filter and policy judges DRA pods alike.

Concerns, one module each: reading a Node (`nodes.py`), the agents' Leases
(`freshness.py`), bound and assumed pods (`assume.py`), DRA objects (`dra.py`,
`drastate.py`) and a DRA pod's assumption (`draassume.py`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from gpudaemon.cluster.assume import AssumeCache, PodUsage
from gpudaemon.cluster.dra import pod_claim_refs
from gpudaemon.cluster.draassume import DraAssumptions
from gpudaemon.cluster.drastate import DraState
from gpudaemon.cluster.freshness import Freshness, lease_entry
from gpudaemon.cluster.nodes import BadNodes, agent_values_id, read_node
from gpudaemon.cluster.podspec import pod_gang, pod_shape
from gpudaemon.cluster.state import NodeState, PodShape, add_mig
from gpudaemon.errors import BadValueError
from gpudaemon.labels.keys import GPU_PRODUCT
from gpudaemon.labels.sanitize import DEFAULT_PREFIX

Obj = Mapping[str, Any]
TERMINAL_PHASES = ("Succeeded", "Failed")
# How long a pod's assumption outlives its leaving the pending watch: the bound-pod
# watch's lag behind it, with room (tens of ms on a healthy API server).
LEFT_PENDING_GRACE_S = 2.0
# A consumer's own reading of a Node or a pod; None (or BadValueError, AttributeError,
# TypeError) leaves the object without one.
View = Callable[[Obj], Any]

__all__ = ["AssumeCache", "Changes", "ClusterState", "Cursor", "NodeListener", "Snapshot", "Views"]

_LOG_MAX = 65_536  # changed node names kept for `changes` readers
Cursor = tuple[int, int]  # (epoch, position in the change log)


@dataclass(frozen=True, slots=True)
class _NodeRead:
    name: str
    meta: Obj
    state: NodeState
    bad: tuple[str, int | None, str] | None = None  # (key, value id, reason)


@dataclass(frozen=True, slots=True)
class Changes:
    """`ClusterState.changes`: the nodes to judge again, as of one moment."""

    cursor: Cursor
    # The nodes changed since the cursor given; None: any node may have (judge all).
    changed: set[str] | None
    states: dict[str, NodeState | None]  # of the changed nodes and the names asked for
    until: dict[str, float]  # wall time each one's agent data goes stale (-inf: is)
    degraded: bool  # some node has a free degraded GPU


@dataclass(frozen=True, slots=True)
class Snapshot:
    states: dict[str, NodeState | None]
    fresh: dict[str, bool]
    # Nodes with a free degraded GPU (of all nodes, not only those named): when none,
    # ranking skips the healthy-GPU preference entirely.
    degraded: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class Views:
    """The consumers' readings, as of one moment: by node name, and by pod UID (bound,
    non-terminal pods only)."""

    nodes: dict[str, Any]
    pods: dict[str, Any]


class NodeListener(Protocol):
    def observe_node(self, node: NodeState) -> None: ...

    def forget_node(self, name: str) -> None: ...


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
        node_view: View | None = None,
        pod_view: View | None = None,
        dra: bool = False,
    ) -> None:
        self.prefix = prefix
        self.product_label = prefix + GPU_PRODUCT
        self.assume_ttl_s = assume_ttl_s
        # A gang's pods wait at Coscheduling's Permit, unbound, until the whole gang has
        # nodes (up to its scheduleTimeoutSeconds): their GPUs stay counted that long.
        self.gang_assume_ttl_s = max(assume_ttl_s, gang_assume_ttl_s)
        # Whether a gang's pods may wait at Permit (the extender asks its pending pods:
        # a native PodGroup's do not, and get the plain TTL).
        self.gang_waits: Callable[[str], bool] = lambda gang: True
        self.clock, self.wall = clock, wall
        self._lock = threading.RLock()
        self._nodes: dict[str, NodeState] = {}  # without pod usage
        self._node_uids: dict[str, str] = {}
        self._usage = PodUsage(assume_ttl_s, self._changed)
        self._bad = BadNodes()
        self._fresh = Freshness(
            lambda n: self._node_uids.get(n, ""), lambda n: n in self._bad.reasons
        )
        self._states: dict[str, NodeState] = {}  # cache of node + usage, per node
        # The names of the nodes whose state or freshness changed, in order (`changes`):
        # a reader that keeps answers per node redoes only these. `_epoch` moves when
        # every node may have changed (a relist), and the log starts over.
        self._log: list[str] = []
        self._log_start = 0  # the position of _log[0] since the epoch began
        self._epoch = 0
        # Told of every node as it appears or changes (without pod usage) and as it goes:
        # the policies' `observe_node` / `forget_node` hooks, off the request path.
        self._node_listeners: list[NodeListener] = []
        self._node_view, self._pod_view = node_view, pod_view
        self._node_views: dict[str, Any] = {}  # by node name: readable nodes only
        self._pod_views: dict[str, Any] = {}  # by pod UID: bound, non-terminal only
        self._degraded: set[str] = set()  # nodes with gpus_degraded_free > 0
        self._raw: dict[str, NodeState] = {}  # as the Node alone says (before DRA)
        self.dra = DraState(self._dra_changed) if dra else None
        self._dra_assumed = DraAssumptions(self._usage, self._claim_allocated, self.dra)

    @property
    def bad_values(self) -> dict[str, int]:
        """Unreadable values seen, by key (once per node and value)."""
        return self._bad.values

    def _changed(self, node: str) -> None:
        """The node's state or freshness may have changed: its cached state is dropped,
        and `changes` reports it."""
        self._states.pop(node, None)
        self._log.append(node)
        if len(self._log) > _LOG_MAX:  # a reader this far behind starts over
            del self._log[: _LOG_MAX // 2]
            self._log_start += _LOG_MAX // 2

    def _changed_all(self) -> None:
        self._states.clear()
        self._epoch += 1
        self._log.clear()
        self._log_start = 0

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
            self._raw.clear()
            self._node_uids.clear()
            self._node_views.clear()
            self._changed_all()
            self._bad.reasons.clear()
            self._degraded.clear()
            for obj in items:
                self._put_node(obj)
            for name in gone - set(self._nodes):
                for listener in self._node_listeners:
                    listener.forget_node(name)
            self._bad.keep_only(set(self._nodes))
            self._fresh.recompute()

    def node_event(self, kind: str, obj: Obj) -> None:
        name = str((obj.get("metadata") or {}).get("name", ""))
        # Read (its annotation decoded) before the lock: requests wait on the lock.
        read = self._read_node(obj) if kind != "DELETED" else None
        with self._lock:
            if kind == "DELETED":
                self._nodes.pop(name, None)
                self._raw.pop(name, None)
                self._node_uids.pop(name, None)
                self._node_views.pop(name, None)
                self._changed(name)
                self._bad.forget(name)
                self._degraded.discard(name)
                for listener in self._node_listeners:
                    listener.forget_node(name)
            else:
                self._put_read(obj, read)
            self._fresh.update(name)

    def _read_node(self, obj: Obj) -> _NodeRead | None:
        """The Node as a state, and why its values are unreadable if they are; None:
        not an object at all. Pure: a watch event is read before the lock is taken."""
        try:
            meta = obj.get("metadata") or {}
            name = str(meta.get("name", ""))
        except Exception:  # not an object at all: nothing to key it by
            return None
        p, product = self.prefix, self.product_label
        try:
            return _NodeRead(name, meta, read_node(name, meta, obj, p, product))
        except BadValueError as e:
            st = read_node(name, meta, obj, p, product, agent=False, bad=str(e))
            return _NodeRead(name, meta, st, (e.key, agent_values_id(meta, p), e.reason))
        except Exception as e:  # a shape the API server would not store: a bug or a fake
            st = NodeState(name=name, has_agent_labels=False, bad_data="unreadable Node object")
            why = f"unreadable Node object ({type(e).__name__})"
            return _NodeRead(name, meta, st, ("node", None, why))

    def _put_node(self, obj: Obj) -> None:
        self._put_read(obj, self._read_node(obj))

    def _put_read(self, obj: Obj, got: _NodeRead | None) -> None:
        """Never raises: a Node whose agent values (or whose object) cannot be read is
        kept as a node with no data (`bad_data`), counted and logged once. `got`: the
        object as `_read_node` read it."""
        if got is None:
            self._bad.note_bad("", "node", None, "not a Node object")
            self._fresh.drop("")
            return
        name, meta, st = got.name, got.meta, got.state
        self._node_views.pop(name, None)
        if got.bad is not None:
            self._bad.note_bad(name, *got.bad)
            self._fresh.drop(name)
        else:
            self._bad.note_good(name)
            self._put_view(self._node_view, self._node_views, name, obj)
        self._raw[name] = st
        st = self._nodes[name] = self._fold(st)
        if st.gpus_degraded_free:
            self._degraded.add(name)
        else:
            self._degraded.discard(name)
        self._node_uids[name] = str(meta.get("uid", ""))
        self._changed(name)
        for listener in self._node_listeners:
            listener.observe_node(st)

    def _fold(self, st: NodeState) -> NodeState:
        return self.dra.fold(st) if self.dra is not None else st

    def _dra_changed(self, name: str) -> None:
        """A node's DRA devices, allocations or taints changed."""
        self._changed(name)
        raw = self._raw.get(name)
        if raw is None:
            return
        st = self._fold(raw)
        if st != self._nodes.get(name):
            self._nodes[name] = st
            for listener in self._node_listeners:
                listener.observe_node(st)

    def _claim_allocated(self, key: str) -> bool:
        return self.dra is not None and self.dra.is_claim_allocated(key)

    @staticmethod
    def _put_view(view: View | None, into: dict[str, Any], key: str, obj: Obj) -> None:
        if view is None:
            return
        try:
            v = view(obj)
        except (BadValueError, AttributeError, TypeError, ValueError):
            return
        if v is not None:
            into[key] = v

    def bad_reason(self, name: str) -> str:
        """Why the node's agent data could not be read; "" when it could."""
        with self._lock:
            return self._bad.reasons.get(name, "")

    def bad_counts(self) -> dict[str, int]:
        """Unreadable values seen, by key (once per node and value): for the metric."""
        with self._lock:
            return dict(self._bad.values)

    # -- pods ---------------------------------------------------------------------

    def replace_pods(self, items: Iterable[Obj]) -> None:
        with self._lock:
            self._usage.drop_all_pods()
            self._pod_views.clear()
            self._changed_all()
            for obj in items:
                self._put_pod(obj)

    def pod_event(self, kind: str, obj: Obj) -> None:
        with self._lock:
            if kind == "DELETED":
                uid = str((obj.get("metadata") or {}).get("uid", ""))
                self._drop_pod(uid)
                self._usage.drop_assumed(uid)
                self._dra_assumed.forget(uid)
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
        if self._dra_assumed.tracks(uid):  # its claims' devices: until allocated
            self._dra_assumed.settle(uid, node, self.clock())
        else:  # bound: the real placement replaces the assumption
            self._usage.drop_assumed(uid)
        if phase in TERMINAL_PHASES:
            return
        try:
            shape = pod_shape(obj, self.product_label)
        except (ValueError, AttributeError, TypeError):  # a quantity we cannot read
            return
        self._usage.put_bound(uid, node, shape, pod_gang(obj))
        self._put_view(self._pod_view, self._pod_views, uid, obj)

    def _drop_pod(self, uid: str) -> None:
        self._usage.drop_pod(uid)
        self._pod_views.pop(uid, None)

    def gang_nodes(self, gang: str) -> dict[str, int]:
        """Nodes holding the gang's pods (bound or assumed), with how many each."""
        with self._lock:
            self._usage.expire(self.clock)
            return self._usage.gang_nodes(gang)

    # -- leases -------------------------------------------------------------------

    def replace_leases(self, items: Iterable[Obj]) -> None:
        with self._lock:
            self._fresh.clear()
            for obj in items:
                self._fresh.lease_event("ADDED", obj)
            self._changed_all()

    def lease_event(self, kind: str, obj: Obj) -> None:
        parsed = lease_entry(kind, obj)  # outside the lock: requests wait on it
        with self._lock:
            self._fresh.put(*parsed)
            self._changed(parsed[0])

    def fresh(self, name: str) -> bool:
        """The agent's Lease is unexpired and owned by this Node object."""
        return self.freshness([name])[name]

    def is_bound(self, uid: str) -> bool:
        with self._lock:
            return uid in self._usage.pods

    # -- assumptions --------------------------------------------------------------

    def assume(self, pod_uid: str, node: str, shape: PodShape, gang: str = "") -> None:
        """Count the pod on `node` until the watch reports where it really went."""
        if not pod_uid or not shape.wants_gpus:
            return
        with self._lock:
            if pod_uid in self._usage.pods:  # already bound: nothing to assume
                return
            ttl = self.gang_assume_ttl_s if gang and self.gang_waits(gang) else self.assume_ttl_s
            shape = self._dra_assumed.unshared(pod_uid, node, shape)  # claims held: once
            self._usage.assume(pod_uid, node, shape, self.clock(), ttl, gang, self.wall())
            self._dra_assumed.note(pod_uid, shape)

    # -- DRA --------------------------------------------------------------------------

    def with_dra(self, pod: Obj, shape: PodShape) -> PodShape:
        """`shape` plus what the pod's DRA claims not yet allocated ask for (if any)."""
        return shape if self.dra is None else self.with_claims(pod_claim_refs(pod), shape)

    def with_claims(self, refs: Sequence[tuple[str, str]], shape: PodShape) -> PodShape:
        """`with_dra` for the claims `dra.pod_claim_refs` read from a pod."""
        if self.dra is None or not refs:
            return shape
        with self._lock:
            needs = self.dra.needs(refs)
        if not needs.parts:
            return shape
        return replace(shape, gpus=shape.gpus + needs.gpus, mig=add_mig(shape.mig, needs.mig),
                       dra=needs.parts)  # fmt: skip

    def dra_holders(self, node: str, gpu_uuid: str) -> list[str]:
        with self._lock:  # pod UIDs holding a device of that GPU through a claim
            return self.dra.holders(node, gpu_uuid) if self.dra is not None else []

    def dra_counts(self) -> tuple[dict[str, int], dict[str, int]]:
        with self._lock:  # (unreadable objects by kind, claims not understood by reason)
            return (dict(self.dra.bad), dict(self.dra.not_understood)) if self.dra else ({}, {})

    def dra_event(self, kind: str) -> Callable[[str, Obj], None]:
        return self._dra_assumed.handler(kind, self._lock, self._settle_one)

    def dra_replace(self, kind: str) -> Callable[[Iterable[Obj]], None]:
        return self._dra_assumed.replacer(kind, self._lock, self._settle_one)

    def _settle_one(self, uid: str) -> None:
        self._dra_assumed.settle(uid, getattr(self._usage.pods.get(uid), "node", ""), self.clock())

    def unassume_if_failed_since(self, pod_uid: str, failed_at: float) -> None:
        """The scheduler reported the pod unschedulable at wall time `failed_at` (its
        PodScheduled=False condition): an assumption made before then is void."""
        with self._lock:
            self._usage.unassume_if_failed_since(pod_uid, failed_at)

    def left_pending(self, pod_uid: str) -> None:
        """The pod left the pending watch: deleted, or bound. kube-scheduler's cache
        forgets an assumed pod on its deletion; our bound-pod watch never sees a pod that
        never bound, and the pending watch's DELETED carries the pod as it was (no node)
        either way. So its assumption lives `LEFT_PENDING_GRACE_S` more at most: time
        for the bound-pod watch to show a binding (which replaces it), not its TTL."""
        with self._lock:
            self._usage.assumed.shorten(pod_uid, self.clock() + LEFT_PENDING_GRACE_S)

    def is_assumed(self, pod_uid: str) -> bool:
        with self._lock:
            return self._usage.assumed.get(pod_uid) is not None

    def unassume(self, pod_uid: str) -> None:
        """The scheduler is trying the pod again, so its last placement did not happen
        (a gang that timed out at Permit, a bind that failed): stop counting it."""
        with self._lock:
            self._usage.drop_assumed(pod_uid)

    # -- reads --------------------------------------------------------------------

    def states(self, names: Iterable[str]) -> dict[str, NodeState | None]:
        """Current state of each named node (None: not in the cache)."""
        with self._lock:
            self._usage.expire(self.clock)
            out: dict[str, NodeState | None] = {}
            for name in names:
                st = self._states.get(name)
                if st is None:
                    base = self._nodes.get(name)
                    if base is not None:
                        g, c, m, mig = self._usage.usage(name)
                        ag, amig = self._usage.assumed_usage(name)
                        dc = self.dra.counts(name) if self.dra is not None else None
                        if dc is not None:  # devices allocated to claims
                            g, mig = g + dc.gpus_allocated, add_mig(mig, dc.mig_allocated)
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

    def snapshot(
        self, names: Sequence[str], uid: str = "", pod: PodShape | None = None
    ) -> Snapshot:
        """States and freshness under one lock; with a pod, as it sees them (credit)."""
        with self._lock:
            degraded = frozenset(self._degraded) if self._degraded else frozenset()
            st = self._dra_assumed.credit(uid, pod, self.states(names))
            return Snapshot(st, self.freshness(names), degraded)

    def changes(self, cursor: Cursor | None, names: Iterable[str] = ()) -> Changes:
        """What changed since `cursor` (from the last call's answer; None: everything),
        for a reader that keeps an answer per node: the nodes whose state or freshness
        may differ, with their states and the wall times their data goes stale, plus
        `names` (nodes the reader has no answer for yet). Assumptions past their
        time-to-live are dropped first, as `states` does."""
        with self._lock:
            self._usage.expire(self.clock)
            start = cursor[1] - self._log_start if cursor is not None else -1
            if cursor is None or cursor[0] != self._epoch or start < 0:
                changed = None
                todo: set[str] = set(self._nodes)
            else:
                changed = set(self._log[start:])
                todo = set(changed)
            todo.update(names)
            states = self.states(todo)
            until = self._fresh.until
            return Changes(
                (self._epoch, self._log_start + len(self._log)),
                changed,
                states,
                {n: until(n) for n in todo},
                bool(self._degraded),
            )

    def freshness(self, names: Iterable[str]) -> dict[str, bool]:
        """`fresh` for many nodes under one lock (the per-request path)."""
        now = self.wall()
        with self._lock:
            return self._fresh.fresh(names, now)

    def views(self) -> Views:
        """The consumers' readings of every node and bound pod, as of one moment
        (copies: the caller plans on them while the watches go on)."""
        with self._lock:
            return Views(dict(self._node_views), dict(self._pod_views))

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
            u, n, leases = self._usage, len(self._nodes), len(self._fresh.leases)
            return {"nodes": n, "pods": len(u.pods), "leases": leases, "assumed": len(u.assumed)}
