"""The per-node freshness Lease: how the agent renews it, and the rule by which a reader
(the extender) judges it. Both live here so they cannot drift apart.

Rule: a node's labels and `<prefix>gpus` annotation are fresh iff its Lease exists and
`now < renewTime + leaseDurationSeconds` (see docs/kubernetes.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from gpudaemon.errors import KubeError
from gpudaemon.kube.client import KubeClient

LEASE_API = "/apis/coordination.k8s.io/v1"


def lease_path(namespace: str, name: str = "") -> str:
    """The Lease (or, with no name, the namespace's Lease collection) API path."""
    base = f"{LEASE_API}/namespaces/{namespace}/leases"
    return f"{base}/{name}" if name else base


def micro_time(t: float) -> str:
    """A Kubernetes MicroTime (RFC 3339 with microseconds, UTC)."""
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(value: Any) -> datetime | None:
    """A Kubernetes Time or MicroTime as an aware datetime; None if absent or malformed."""
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def lease_expiry(lease: Mapping[str, Any] | None) -> datetime | None:
    """When the Lease stops vouching for its node's data (renewTime +
    leaseDurationSeconds); None if it is absent or malformed, which vouches for nothing."""
    if not lease:
        return None
    spec = lease.get("spec")
    if not isinstance(spec, Mapping):
        return None
    renewed = parse_time(spec.get("renewTime"))
    duration = spec.get("leaseDurationSeconds")
    if renewed is None or not isinstance(duration, int) or isinstance(duration, bool):
        return None
    try:  # the node's identity writes its Lease: year 9999 plus a day does not exist
        return renewed + timedelta(seconds=duration)
    except OverflowError:
        return None


# Another identity's Lease is bounded by our rules before it is believed (a stolen or
# careless token could write renewTime 2099 and a duration of 2**31 - 1 s):
MAX_CLOCK_SKEW_S = 60.0  # a renewTime further ahead of our clock than this: not held
MAX_LEADER_LEASE_S = 3600  # the rebalancer's longest lease_duration_s (config caps it)


def lease_held_until(
    lease: Mapping[str, Any] | None,
    now: float,
    max_duration_s: float = MAX_LEADER_LEASE_S,
    skew_s: float = MAX_CLOCK_SKEW_S,
) -> float | None:
    """Wall time (s) until which a leader Lease is held by our rules, `now` being our
    wall clock; None when it is not held at all: absent or malformed, no holder, a
    renewTime more than `skew_s` ahead of `now`, or a leaseDurationSeconds outside
    (0, `max_duration_s`]. Such a Lease is as good as expired: a standby takes it over
    (after its own renew deadline) and its annotations are not believed."""
    spec = lease.get("spec") if lease else None
    if not isinstance(spec, Mapping):
        return None
    holder = spec.get("holderIdentity")
    duration = spec.get("leaseDurationSeconds")
    if not isinstance(holder, str) or not holder:
        return None
    if not isinstance(duration, int) or isinstance(duration, bool):
        return None
    if not 0 < duration <= max_duration_s:
        return None
    renewed = parse_time(spec.get("renewTime"))
    if renewed is None:
        return None
    at = renewed.timestamp()
    if at > now + skew_s:
        return None  # from the future: forged, or a clock far beyond any skew we allow
    return at + duration


def lease_is_fresh(lease: Mapping[str, Any] | None, now: datetime) -> bool:
    """True iff the Lease vouches for its node's data at `now` (an aware datetime;
    a naive one is taken as UTC): its `lease_expiry` is still ahead."""
    expiry = lease_expiry(lease)
    if expiry is None:
        return False
    if now.tzinfo is None:
        now = now.replace(tzinfo=UTC)
    return now < expiry


# Periods a cron expression can repeat at evenly: steps that divide 60 s, 60 min, 24 h.
_STEPS_S = (1, 2, 3, 4, 5, 6, 10, 12, 15, 20, 30)
_STEPS_MIN = (1, 2, 3, 4, 5, 6, 10, 12, 15, 20, 30)
_STEPS_H = (1, 2, 3, 4, 6, 8, 12)


def renew_period_s(lease_duration_s: int) -> int:
    """The renewal period: the longest even cron period up to a third of the duration,
    so two renewals in a row may fail before readers see the data as stale."""
    target = max(1, lease_duration_s // 3)
    periods = [*_STEPS_S, *(60 * m for m in _STEPS_MIN), *(3600 * h for h in _STEPS_H), 86400]
    return max(p for p in periods if p <= target) if target >= 1 else 1


def renew_cron(lease_duration_s: int) -> str:
    """A valid six-field cron for `renew_period_s`, for any positive duration
    (default 360 s -> every 2 min: 30 writes per node-hour)."""
    every = renew_period_s(lease_duration_s)
    if every < 60:
        return f"*/{every} * * * * *"
    if every < 3600:
        return f"0 */{every // 60} * * * *"
    if every < 86400:
        return f"0 0 */{every // 3600} * * *"
    return "0 0 0 * * *"


class LeaseRenewer:
    """Server-side applies Lease `<namespace>/<node>`: holder, duration, renewTime.

    It renews whenever asked; whether the data deserves a renewal is the caller's call
    (see NodeLabelSink.heartbeat). A failure raises KubeError: the agent's job wrapper
    counts it and logs the first of a run of failures, and when it works again.
    """

    def __init__(
        self,
        client: KubeClient,
        namespace: str,
        node: str,
        duration_s: int,
        holder: str,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.client = client
        self.namespace, self.node = namespace, node
        self.duration_s = duration_s
        self.holder = holder
        self.clock = clock
        self._acquired_at: float | None = None

    def renew(self, node_uid: str | None = None) -> bool:
        """One renewal; True if the Lease was written. `node_uid` makes the Node its
        owner, so the Lease is garbage-collected with the Node (like kubelet's)."""
        now = self.clock()
        if self._acquired_at is None:
            self._acquired_at = now
        self._apply(self.holder, self.duration_s, self._acquired_at, now, node_uid, "renewed")
        return True

    def release(self, node_uid: str | None = None) -> None:
        """On a graceful stop, as client-go's ReleaseOnCancel: no holder, and a duration
        of one second from now, so every reader sees the node's data as stale within a
        second instead of at the end of the full duration. Raises KubeError."""
        now = self.clock()
        acquired = self._acquired_at if self._acquired_at else now
        self._apply("", 1, acquired, now, node_uid, "released")

    def _apply(
        self, holder: str, duration_s: int, acquired: float, now: float,
        node_uid: str | None, what: str,
    ) -> None:  # fmt: skip
        spec = {
            "holderIdentity": holder,
            "leaseDurationSeconds": duration_s,
            "acquireTime": micro_time(acquired),
            "renewTime": micro_time(now),
        }
        owner = None
        if node_uid:
            owner = {"apiVersion": "v1", "kind": "Node", "name": self.node, "uid": node_uid}
        try:
            self.client.apply_lease(self.namespace, self.node, spec, owner)
        except KubeError as e:
            raise type(e)(f"node {self.node}: lease not {what}: {e}", e.status) from None
