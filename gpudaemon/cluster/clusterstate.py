"""The programs' view of the cluster: one `NodeState` per node, read from the Node
informer's store, with the usage of the bound pods (from the pod informer's store) and
of provisional placements ("assumed" pods, `assume.py`). A request reads it through
`snapshot`: every named node's state and freshness as of one moment.

One store per resource, shared by every consumer (client-go's rule): the informers'
stores hold each Node and bound pod in the form read here (`keep_node`: a `NodeRecord`;
`keep_pod`: a `BoundPod`), made once as the object arrives, and this class keeps only
what is derived from them (usage sums, the change log, assumptions, freshness), updated
by its store handlers. A program that needs more of a Node or a pod than that registers a
`node_view` or `pod_view`: its reading is kept in the same record, not in a mirror cache.
Standalone (tests, benchmarks) it owns stores of the same kind, fed by `replace_nodes`,
`node_event`, `replace_pods` and `pod_event`; `watch` puts it on a program's informers.

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
from gpudaemon.cluster.freshness import Freshness, lease_entry, lease_key
from gpudaemon.cluster.nodes import BadNodes, agent_values_id, read_node
from gpudaemon.cluster.podspec import pod_gang, pod_shape
from gpudaemon.cluster.selectors import POD_FORM, POD_SELECTOR
from gpudaemon.cluster.state import NodeState, PodShape, add_mig
from gpudaemon.errors import BadValueError
from gpudaemon.kube.informers import Informer, InformerFactory, Store, uid_key
from gpudaemon.kube.lease import lease_path
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

__all__ = [
    "AssumeCache", "BoundPod", "Changes", "ClusterState", "Cursor", "NodeListener",
    "NodeRecord", "Snapshot", "Views", "node_key",
]  # fmt: skip

_LOG_MAX = 65_536  # changed node names kept for `changes` readers
Cursor = tuple[int, int]  # (epoch, position in the change log)


@dataclass(frozen=True, slots=True)
class NodeRecord:
    """What the Node store keeps of a Node (`ClusterState.keep_node`): a few hundred
    bytes, however large the Node object."""

    name: str
    uid: str
    state: NodeState  # as the Node alone says (before DRA)
    bad: tuple[str, int | None, str] | None = None  # (key, value id, reason)
    view: Any = None  # the program's `node_view` of it (readable nodes only)


@dataclass(frozen=True, slots=True)
class BoundPod:
    """What the bound-pod store keeps of a pod (`ClusterState.keep_pod`): what it adds
    to its node's usage."""

    uid: str
    node: str
    shape: PodShape | None  # None: not counted (terminal, or requests unreadable)
    gang: str = ""
    view: Any = None  # the program's `pod_view` of it (counted pods only)


def node_key(obj: Obj) -> str:
    """The Node store's key: the Node's name (as `NodeRecord.name`)."""
    name = (obj.get("metadata") or {}).get("name")
    return name if isinstance(name, str) else ""


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
    """Thread-safe view of the Node, bound-pod and Lease stores, with what derives
    from them; fed by those informers' store handlers."""

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
        self._node_view, self._pod_view = node_view, pod_view
        # The stores: own ones until `watch` puts it on the informers'.
        self._nodes = Store("nodes", self.keep_node, node_key)  # NodeRecord by name
        self._pods = Store("pods", self.keep_pod, uid_key)  # BoundPod by UID
        self._bound = 0  # pods counted (BoundPod.shape set)
        self._usage = PodUsage(assume_ttl_s, self._changed)
        self._bad = BadNodes()
        self._fresh = Freshness(self._node_uid, lambda n: n in self._bad.reasons)
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
        self._degraded: set[str] = set()  # nodes with gpus_degraded_free > 0
        # With DRA, each node's state with its devices folded in (derived from the
        # store's and DraState's); without, the store's state is the node's.
        self._folded: dict[str, NodeState] = {}
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
            for rec in self._nodes.items():
                listener.observe_node(self._node_state(rec))

    def watch(
        self, factory: InformerFactory, lease_namespace: str
    ) -> tuple[Informer, Informer, Informer]:
        """Registers the Node, bound-pod and agent-Lease informers of a program on
        `factory` and reads Nodes, bound pods and Leases from their stores from now on
        (call it before the informers start). Returns them (nodes, pods, leases), for the
        program's other handlers, which run after these."""
        nodes = factory.informer("nodes", "/api/v1/nodes", keep=self.keep_node, key=node_key)
        pods = factory.informer("pods", "/api/v1/pods", {"fieldSelector": POD_SELECTOR},
                                keep=self.keep_pod, key=uid_key, **POD_FORM)  # fmt: skip
        leases = factory.informer("leases", lease_path(lease_namespace), keep=lease_entry,
                                  key=lease_key)  # fmt: skip
        if nodes.store is None or pods.store is None or leases.store is None:
            raise RuntimeError("ClusterState.watch: an informer without a store")
        with self._lock:
            self._nodes, self._pods = nodes.store, pods.store
            self._fresh.leases = leases.store
        nodes.add_store_handler(self.nodes_replaced, self.node_changed)
        pods.add_store_handler(self.pods_replaced, self.pod_changed)
        leases.add_store_handler(self.leases_replaced, self.lease_changed)
        return nodes, pods, leases

    def _node_uid(self, name: str) -> str:
        rec = self._nodes.get(name)
        return rec.uid if rec is not None else ""

    def _node_state(self, rec: NodeRecord) -> NodeState:
        """The node's state without pod usage (with its DRA devices, if on)."""
        return self._folded.get(rec.name, rec.state) if self.dra is not None else rec.state

    # -- nodes --------------------------------------------------------------------

    def replace_nodes(self, items: Iterable[Obj]) -> None:
        """A relist of the Nodes, into the node store (what the informer does)."""
        items = list(items)
        self.nodes_replaced(*self._nodes.replace(items))
        for obj in items:  # the store keeps no record of these: say so, as an event would
            if not self._nodes.key_of(obj):
                self.node_changed("ADDED", "", None, None)

    def node_event(self, kind: str, obj: Obj) -> None:
        """A watch event, into the node store (what the informer does)."""
        self.node_changed(kind, *self._nodes.apply(kind, obj))

    def nodes_replaced(self, old: Mapping[str, Any], new: Mapping[str, Any]) -> None:
        """The node store was relisted: everything derived from it is redone."""
        with self._lock:
            self._folded.clear()
            self._changed_all()
            self._bad.reasons.clear()
            self._degraded.clear()
            for rec in new.values():
                self._took(rec)
            for name in old.keys() - new.keys():
                for listener in self._node_listeners:
                    listener.forget_node(name)
            self._bad.keep_only(set(new))
            self._fresh.recompute()

    def node_changed(self, kind: str, name: str, old: Any, new: Any) -> None:
        """The node store took an event: `new` is the Node's record now (None: gone)."""
        with self._lock:
            if new is not None:
                self._took(new)
            elif not name:  # nothing to key it by
                self._bad.note_bad("", "node", None, "not a Node object")
                self._fresh.drop("")
                return
            else:
                self._folded.pop(name, None)
                self._changed(name)
                self._bad.forget(name)
                self._degraded.discard(name)
                for listener in self._node_listeners:
                    listener.forget_node(name)
            self._fresh.update(name)

    def keep_node(self, obj: Obj) -> NodeRecord | None:
        """The Node store's form of a Node (its `keep`): its state read with the bounded
        decoders, and why its values are unreadable if they are; None: not an object at
        all. Pure, and run by the informer before any lock is taken."""
        try:
            meta = obj.get("metadata") or {}
            name = str(meta.get("name", ""))
            uid = str(meta.get("uid", ""))
        except Exception:  # not an object at all: nothing to key it by
            return None
        p, product = self.prefix, self.product_label
        try:
            st = read_node(name, meta, obj, p, product)
        except BadValueError as e:
            st = read_node(name, meta, obj, p, product, agent=False, bad=str(e))
            return NodeRecord(name, uid, st, (e.key, agent_values_id(meta, p), e.reason))
        except Exception as e:  # a shape the API server would not store: a bug or a fake
            st = NodeState(name=name, has_agent_labels=False, bad_data="unreadable Node object")
            why = f"unreadable Node object ({type(e).__name__})"
            return NodeRecord(name, uid, st, ("node", None, why))
        return NodeRecord(name, uid, st, None, self._view(self._node_view, obj))

    def _took(self, rec: NodeRecord) -> None:
        """The derived state of a node the store now holds as `rec`. Never raises: a
        Node whose agent values (or whose object) cannot be read is kept as a node with
        no data (`bad_data`), counted and logged once."""
        name = rec.name
        if rec.bad is not None:
            self._bad.note_bad(name, *rec.bad)
            self._fresh.drop(name)
        else:
            self._bad.note_good(name)
        st = self._fold(rec.state)
        if self.dra is not None:
            self._folded[name] = st
        if st.gpus_degraded_free:
            self._degraded.add(name)
        else:
            self._degraded.discard(name)
        self._changed(name)
        for listener in self._node_listeners:
            listener.observe_node(st)

    def _fold(self, st: NodeState) -> NodeState:
        return self.dra.fold(st) if self.dra is not None else st

    def _dra_changed(self, name: str) -> None:
        """A node's DRA devices, allocations or taints changed."""
        self._changed(name)
        rec = self._nodes.get(name)
        if rec is None:
            return
        st = self._fold(rec.state)
        if st != self._folded.get(name):
            self._folded[name] = st
            for listener in self._node_listeners:
                listener.observe_node(st)

    def _claim_allocated(self, key: str) -> bool:
        return self.dra is not None and self.dra.is_claim_allocated(key)

    @staticmethod
    def _view(view: View | None, obj: Obj) -> Any:
        if view is None:
            return None
        try:
            return view(obj)
        except (BadValueError, AttributeError, TypeError, ValueError):
            return None

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
        """A relist of the bound pods, into the pod store (what the informer does)."""
        self.pods_replaced(*self._pods.replace(items))

    def pod_event(self, kind: str, obj: Obj) -> None:
        """A watch event, into the pod store (what the informer does)."""
        self.pod_changed(kind, *self._pods.apply(kind, obj))

    def keep_pod(self, obj: Obj) -> BoundPod | None:
        """The pod store's form of a pod (its `keep`): its node and what it adds there;
        None: not bound (nothing to keep). Pure, and run before any lock is taken."""
        meta = obj.get("metadata") or {}
        node = str((obj.get("spec") or {}).get("nodeName") or "")
        if not node:
            return None
        uid = str(meta.get("uid", ""))
        if (obj.get("status") or {}).get("phase") in TERMINAL_PHASES:
            return BoundPod(uid, node, None)
        try:
            shape = pod_shape(obj, self.product_label)
        except (ValueError, AttributeError, TypeError):  # a quantity we cannot read
            return BoundPod(uid, node, None)
        return BoundPod(uid, node, shape, pod_gang(obj), self._view(self._pod_view, obj))

    def pods_replaced(self, old: Mapping[str, Any], new: Mapping[str, Any]) -> None:
        """The pod store was relisted: the sums are redone from it."""
        with self._lock:
            self._usage.drop_all_bound()
            self._bound = 0
            self._changed_all()
            for rec in new.values():
                self._took_pod(rec)

    def pod_changed(self, kind: str, uid: str, old: Any, new: Any) -> None:
        """The pod store took an event: `old` was its record, `new` is (None: none)."""
        with self._lock:
            if old is not None and old.shape is not None:
                self._usage.add_bound(old.node, old.shape, old.gang, -1)
                self._bound -= 1
            if kind == "DELETED":
                self._usage.drop_assumed(uid)
                self._dra_assumed.forget(uid)
            elif new is not None:
                self._took_pod(new)

    def _took_pod(self, rec: BoundPod) -> None:
        uid = rec.uid
        if self._dra_assumed.tracks(uid):  # its claims' devices: until allocated
            self._dra_assumed.settle(uid, rec.node, self.clock())
        else:  # bound: the real placement replaces the assumption
            self._usage.drop_assumed(uid)
        if rec.shape is not None:
            self._usage.add_bound(rec.node, rec.shape, rec.gang)
            self._bound += 1

    def _bound_node(self, uid: str) -> str:
        """The node the pod is bound to and counted on; "" if none."""
        rec = self._pods.get(uid) if uid else None
        return rec.node if rec is not None and rec.shape is not None else ""

    def gang_nodes(self, gang: str) -> dict[str, int]:
        """Nodes holding the gang's pods (bound or assumed), with how many each."""
        with self._lock:
            self._usage.expire(self.clock)
            return self._usage.gang_nodes(gang)

    # -- leases -------------------------------------------------------------------

    def replace_leases(self, items: Iterable[Obj]) -> None:
        """A relist of the agents' Leases, into the Lease store (what the informer does)."""
        self.leases_replaced(*self._fresh.leases.replace(items))

    def lease_event(self, kind: str, obj: Obj) -> None:
        """A watch event, into the Lease store (what the informer does)."""
        self.lease_changed(kind, *self._fresh.leases.apply(kind, obj))

    def leases_replaced(self, old: Mapping[str, Any], new: Mapping[str, Any]) -> None:
        with self._lock:
            self._fresh.recompute()
            self._changed_all()

    def lease_changed(self, kind: str, name: str, old: Any, new: Any) -> None:
        with self._lock:
            self._fresh.update(name)
            self._changed(name)

    def fresh(self, name: str) -> bool:
        """The agent's Lease is unexpired and owned by this Node object."""
        return self.freshness([name])[name]

    def is_bound(self, uid: str) -> bool:
        return bool(self._bound_node(uid))

    # -- assumptions --------------------------------------------------------------

    def assume(self, pod_uid: str, node: str, shape: PodShape, gang: str = "") -> None:
        """Count the pod on `node` until the watch reports where it really went."""
        if not pod_uid or not shape.wants_gpus:
            return
        with self._lock:
            if self._bound_node(pod_uid):  # already bound: nothing to assume
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
        self._dra_assumed.settle(uid, self._bound_node(uid), self.clock())

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
                    rec = self._nodes.get(name)
                    if rec is not None:
                        base = self._node_state(rec)
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
                todo: set[str] = set(self._nodes.keys())
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
            nodes = {r.name: r.view for r in self._nodes.items() if r.view is not None}
            pods = {r.uid: r.view for r in self._pods.items() if r.view is not None}
            return Views(nodes, pods)

    def gpu_node_names(self) -> list[str]:
        """Nodes with GPUs: an agent labelled them or they have nvidia.com/gpu."""
        with self._lock:
            states = map(self._node_state, self._nodes.items())
            return sorted(
                st.name
                for st in states
                if st.has_agent_labels or st.gpus_allocatable or st.mig_allocatable
            )

    def sizes(self) -> dict[str, int]:
        with self._lock:
            u, n, leases = self._usage, len(self._nodes), len(self._fresh.leases)
            return {"nodes": n, "pods": self._bound, "leases": leases, "assumed": len(u.assumed)}
