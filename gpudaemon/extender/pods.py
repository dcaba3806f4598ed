"""Which pods the extender may book GPUs for: only real pods, never a body's word.

A placement is assumed (GPUs counted on a node before the binding) only for a pod that
exists in the API, is unbound, names our scheduler, and with the requests the API has
for it, not the body's. Without this, anyone who can reach the extender could invent
pod UIDs and keep every GPU "assumed" for `assume_ttl_s`, and skew what the
fragmentation policy learns.

`PendingPods` is a watch cache of the unbound pods of our scheduler (fed by a
Reflector). A UID it does not know yet (the watch lags the scheduler by a few ms) is
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
from gpudaemon.cluster.state import PodShape
from gpudaemon.config import DNS1123_SUBDOMAIN
from gpudaemon.errors import KubeError, KubeNotFoundError

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


class PendingPods:
    """Thread-safe map of pending pods by UID, fed by a Reflector."""

    def __init__(self, product_label: str) -> None:
        self.product_label = product_label
        self._lock = threading.Lock()
        self._by_uid: dict[str, RealPod] = {}
        self._gangs: dict[str, dict[str, RealPod]] = {}  # gang -> its pending pods by UID

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
        pods = {p.uid: p for o in items if (p := self.parse(o)) is not None}
        gangs: dict[str, dict[str, RealPod]] = {}
        for p in pods.values():
            if p.gang:
                gangs.setdefault(p.gang, {})[p.uid] = p
        with self._lock:
            self._by_uid, self._gangs = pods, gangs

    def event(self, kind: str, obj: Obj) -> None:
        uid = str((obj.get("metadata") or {}).get("uid") or "")
        pod = None if kind == "DELETED" else self.parse(obj)
        with self._lock:
            self._drop(uid)
            if pod is not None:
                self._put(pod)

    def add(self, pod: RealPod) -> None:
        with self._lock:
            self._drop(pod.uid)
            self._put(pod)

    def _put(self, pod: RealPod) -> None:
        self._by_uid[pod.uid] = pod
        if pod.gang:
            self._gangs.setdefault(pod.gang, {})[pod.uid] = pod

    def _drop(self, uid: str) -> None:
        old = self._by_uid.pop(uid, None)
        if old is not None and old.gang:
            members = self._gangs.get(old.gang, {})
            members.pop(uid, None)
            if not members:
                self._gangs.pop(old.gang, None)

    def gang_members(self, gang: str) -> list[RealPod]:
        """The gang's pods that are not bound yet (waiting at Permit included)."""
        with self._lock:
            return list(self._gangs.get(gang, {}).values())

    def waits_at_permit(self, gang: str) -> bool:
        """Whether the gang's pods may wait unbound at Permit for the rest (Coscheduling),
        so an assumption of one must outlive the plain TTL. A native gang is placed in
        one group cycle: a member assumed in a cycle that failed is never tried again
        until something changes, so its assumption must not hold GPUs for long. True
        for a gang of which no pending pod is known: the old, cautious rule."""
        with self._lock:
            members = self._gangs.get(gang)
            return not members or not all(p.native_gang for p in members.values())

    def get(self, uid: str) -> RealPod | None:
        with self._lock:
            return self._by_uid.get(uid)

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_uid)


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
