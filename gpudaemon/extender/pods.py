"""Which pods the extender may book GPUs for: only real pods, never a body's word.

A placement is assumed (GPUs counted on a node before the binding) only for a pod that
exists in the API, is unbound, names our scheduler, and with the requests the API has
for it, not the body's. Without this, anyone who can reach the extender could invent
pod UIDs and keep every GPU "assumed" for `assume_ttl_s`, and skew what the
fragmentation policy learns.

`PendingPods` reads the unbound pods of our scheduler from the pending informer's
store, which holds each one as a `RealPod` (its `keep` is `PendingPods.parse`), indexed
by pod group. A UID it does not know yet (the watch lags the scheduler by a few ms) is
looked up once in the API, at most `lookups_per_second`, and a miss is remembered in
a bounded negative cache, so a flood of invented UIDs costs neither memory nor API
server load.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpudaemon.cluster.dra import pod_claim_refs
from gpudaemon.cluster.podspec import native_pod_group, pod_gang, pod_priority, pod_shape
from gpudaemon.cluster.selectors import POD_FORM, pending_selector
from gpudaemon.cluster.state import PodShape
from gpudaemon.config import DNS1123_SUBDOMAIN
from gpudaemon.errors import KubeError, KubeNotFoundError
from gpudaemon.kube.informers import Informer, InformerFactory, Store, uid_key

Obj = Mapping[str, Any]

# Why a request's pod was not booked: the reasons of gpudaemon_extender_unverified_pods_total.
REASONS = ("no_uid", "unknown_pod", "bound", "other_scheduler", "rate_limited", "api_error")


@dataclass(frozen=True, slots=True)
class RealPod:
    uid: str
    namespace: str
    name: str
    shape: PodShape
    gang: str = ""  # namespace/podgroup (native PodGroup or Coscheduling's), "" for none
    priority: int = 0
    native_gang: bool = False  # of a native PodGroup (spec.schedulingGroup)
    # Its DRA claims (dra.pod_claim_refs): what they ask for is read when it is judged,
    # as the claims are created and allocated after the pod.
    claims: tuple[tuple[str, str], ...] = ()


priority_of = pod_priority  # spec.priority (the reserved plug-in reads it too)


def by_gang(pod: RealPod) -> list[str]:
    """The pending store's index: a pod's gang ("namespace/podgroup"), if any."""
    return [pod.gang] if pod.gang else []


class PendingPods:
    """Pending pods by UID: a view of the pending informer's store (`watch`), or of a
    store of its own fed by `replace` and `event` (tests, benchmarks). Besides the store
    it keeps only the pods `PodVerifier` looked up in the API before the watch showed
    them (`add`), each until the watch says anything of it or relists."""

    def __init__(self, product_label: str) -> None:
        self.product_label = product_label
        self._lock = threading.Lock()
        self._store = self._new_store()
        self._added: dict[str, RealPod] = {}  # looked up, not yet in the store

    def _new_store(self) -> Store:
        store = Store("pending", self.parse, uid_key)
        store.add_indexer("gang", by_gang)
        return store

    def watch(self, factory: InformerFactory, scheduler_name: str) -> Informer:
        """Registers the pending informer (our scheduler's unbound pods) on `factory`
        and reads its store from now on (before the informers start); returns it, for
        the program's other handlers, which run after this one's."""
        mine = {"fieldSelector": pending_selector(scheduler_name)}
        inf = factory.informer("pending", "/api/v1/pods", mine, keep=self.parse, key=uid_key,
                               **POD_FORM)  # fmt: skip
        if inf.store is None:  # store=True above
            raise RuntimeError("pending informer without a store")
        inf.add_indexer("gang", by_gang)
        with self._lock:
            self._store = inf.store
        inf.add_store_handler(self.replaced, self.changed)
        return inf

    def parse(self, obj: Obj) -> RealPod | None:
        meta = obj.get("metadata") or {}
        uid = str(meta.get("uid") or "")
        if not uid or (obj.get("spec") or {}).get("nodeName"):
            return None
        try:
            shape = pod_shape(obj, self.product_label)
        except (ValueError, AttributeError, TypeError):
            return None
        return RealPod(
            uid,
            str(meta.get("namespace", "")),
            str(meta.get("name", "")),
            shape,
            pod_gang(obj),
            priority_of(obj),
            bool(native_pod_group(obj)),
            pod_claim_refs(obj),
        )

    def replace(self, items: Iterable[Obj]) -> None:
        """A relist, into the store (what the informer does)."""
        self.replaced(*self._store.replace(items))

    def event(self, kind: str, obj: Obj) -> None:
        """A watch event, into the store (what the informer does)."""
        self.changed(kind, *self._store.apply(kind, obj))

    def replaced(self, old: Mapping[str, Any], new: Mapping[str, Any]) -> None:
        """The store was relisted: what it lacks is not pending."""
        with self._lock:
            self._added.clear()

    def changed(self, kind: str, uid: str, old: Any, new: Any) -> None:
        """The store took an event for `uid`: the watch speaks for it now."""
        with self._lock:
            self._added.pop(uid, None)

    def add(self, pod: RealPod) -> None:
        """A pod looked up in the API, until the watch shows it (or relists)."""
        with self._lock:
            self._added[pod.uid] = pod

    def gang_members(self, gang: str) -> list[RealPod]:
        """The gang's pods that are not bound yet (waiting at Permit included)."""
        members: list[RealPod] = self._store.by_index("gang", gang)
        with self._lock:
            if not self._added:
                return members
            extra = [p for p in self._added.values() if p.gang == gang]
        if not extra:
            return members
        known = {p.uid for p in members}
        return members + [p for p in extra if p.uid not in known]

    def waits_at_permit(self, gang: str) -> bool:
        """Whether the gang's pods may wait unbound at Permit for the rest (Coscheduling),
        so an assumption of one must outlive the plain TTL. A native gang is placed in
        one group cycle: a member assumed in a cycle that failed is never tried again
        until something changes, so its assumption must not hold GPUs for long. True
        for a gang of which no pending pod is known: the old, cautious rule."""
        members = self.gang_members(gang)
        return not members or not all(p.native_gang for p in members)

    def get(self, uid: str) -> RealPod | None:
        pod: RealPod | None = self._store.get(uid)
        if pod is not None:
            return pod
        with self._lock:
            return self._added.get(uid)

    def __len__(self) -> int:
        with self._lock:
            added = len(self._added)
        return len(self._store) + added


class TokenBucket:
    def __init__(
        self, per_second: float, burst: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.rate, self.burst, self.clock = per_second, burst, clock
        self._tokens, self._at = burst, clock()
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            now = self.clock()
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
            self._at = now
            if self._tokens < 1:
                return False
            self._tokens -= 1
            return True


PodLookup = Callable[[str, str], Obj]  # (namespace, name) -> the Pod; KubeError on failure


class PodVerifier:
    """`verify(body_pod)` -> (the real pod, "") or (None, reason)."""

    def __init__(
        self,
        pending: PendingPods,
        lookup: PodLookup,
        scheduler_name: str,
        *,
        is_bound: Callable[[str], bool] = lambda uid: False,
        lookups_per_second: float = 20.0,
        negative_size: int = 4096,
        negative_ttl_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pending = pending
        self.lookup = lookup
        self.scheduler_name = scheduler_name
        self.is_bound = is_bound
        self.bucket = TokenBucket(lookups_per_second, max(1.0, lookups_per_second), clock)
        self.negative_size = negative_size
        self.negative_ttl_s = negative_ttl_s
        self.clock = clock
        self._lock = threading.Lock()
        self._negative: OrderedDict[str, tuple[float, str]] = OrderedDict()  # uid -> (until, why)

    def verify(self, body_pod: Obj) -> tuple[RealPod | None, str]:
        meta = body_pod.get("metadata") or {}
        uid = meta.get("uid") if isinstance(meta, Mapping) else None
        if not isinstance(uid, str) or not uid:
            return None, "no_uid"
        known = self.pending.get(uid)
        if known is not None:
            return known, ""
        if self.is_bound(uid):
            return None, "bound"
        why = self._negative_hit(uid)
        if why:
            return None, why
        ns, name = meta.get("namespace"), meta.get("name")
        if not (isinstance(ns, str) and isinstance(name, str)):
            return None, self._remember(uid, "unknown_pod")
        # Names as the API allows them (config's DNS-1123 rule, the Node name's), checked
        # before they go into an API path.
        if not all(len(v) <= 253 and DNS1123_SUBDOMAIN.fullmatch(v) for v in (ns, name)):
            return None, self._remember(uid, "unknown_pod")
        if not self.bucket.take():
            return None, "rate_limited"
        try:
            obj = self.lookup(ns, name)
        except KubeNotFoundError:
            return None, self._remember(uid, "unknown_pod")
        except KubeError:
            return None, "api_error"
        got = obj.get("metadata") or {}
        spec = obj.get("spec") or {}
        if got.get("uid") != uid:
            return None, self._remember(uid, "unknown_pod")
        if spec.get("nodeName"):
            return None, "bound"
        if spec.get("schedulerName") != self.scheduler_name:
            return None, self._remember(uid, "other_scheduler")
        pod = self.pending.parse(obj)
        if pod is None:
            return None, self._remember(uid, "unknown_pod")
        self.pending.add(pod)  # the watch confirms it (or removes it) shortly
        return pod, ""

    def _negative_hit(self, uid: str) -> str:
        with self._lock:
            hit = self._negative.get(uid)
            if hit is None:
                return ""
            if hit[0] <= self.clock():
                del self._negative[uid]
                return ""
            return hit[1]

    def _remember(self, uid: str, why: str) -> str:
        with self._lock:
            self._negative[uid] = (self.clock() + self.negative_ttl_s, why)
            self._negative.move_to_end(uid)
            while len(self._negative) > self.negative_size:
                self._negative.popitem(last=False)
        return why

    def negative_size_now(self) -> int:
        with self._lock:
            return len(self._negative)
