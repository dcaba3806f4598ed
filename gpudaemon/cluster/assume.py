"""Pod accounting for `ClusterState`: the requests of the bound pods and of the pods
assumed on a node before the watch shows their binding, summed per node, and which
nodes hold each gang's pods. The bound pods themselves are the pod informer's store
(`ClusterState` tells this module each one's arrival and departure); only the sums
and the assumptions live here.

Why assume: the scheduler binds asynchronously and the pod watch lags by tens of ms, so
in a burst several pods would be scored from the same stale count and pile onto the
node that looked best. When prioritize ranks a node first for a pod, that pod's
requests are counted on that node (keyed by pod UID) until the watch shows the pod
bound (the real binding replaces the assumption, wherever it landed), the pod goes
away, or its time-to-live passes (the scheduler chose a node we ranked lower and the
pod is gone before we saw it, or it stayed pending).

Nothing here is locked: ClusterState holds its lock around every call.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from gpudaemon.cluster.state import MigCounts, PodShape, add_mig

# node -> (gpus, cpu m, mem B, MIG devices by profile)
Usage = tuple[int, int, int, MigCounts]


@dataclass(frozen=True, slots=True)
class _Assumed:
    node: str
    shape: PodShape
    expires_at: float
    gang: str = ""
    assumed_wall: float = 0.0  # wall-clock time of the assumption


class AssumeCache:
    """Pods counted on a node before the watch shows their binding, by pod UID, each
    until a deadline (kube-scheduler's assume cache)."""

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

    def shorten(self, uid: str, deadline: float) -> None:
        """Let `uid`'s assumption run out by `deadline` at the latest."""
        a = self._by_uid.get(uid)
        if a is not None and a.expires_at > deadline:
            self._by_uid[uid] = replace(a, expires_at=deadline)

    def expire(self, now: float) -> list[_Assumed]:
        """Remove and return the assumptions whose deadline has passed."""
        gone = [u for u, a in self._by_uid.items() if a.expires_at <= now]
        return [self._by_uid.pop(u) for u in gone]

    def values(self) -> list[_Assumed]:
        return list(self._by_uid.values())

    def __len__(self) -> int:
        return len(self._by_uid)


class PodUsage:
    """Bound (non-terminal) and assumed pods, summed per node. `changed(node)` is
    called whenever a node's sums change (ClusterState drops its cached state)."""

    def __init__(self, ttl_s: float, changed: Callable[[str], None]) -> None:
        self._changed = changed
        self._usage: dict[str, Usage] = {}  # bound and assumed pods
        self._assumed_usage: dict[str, tuple[int, MigCounts]] = {}  # assumed alone
        self.assumed = AssumeCache(ttl_s)
        self._gangs: dict[str, dict[str, int]] = {}  # gang -> node -> its pods there

    # -- bound pods ---------------------------------------------------------------

    def add_bound(self, node: str, shape: PodShape, gang: str, sign: int = +1) -> None:
        """A bound pod counted on `node` (sign -1: no longer)."""
        self._add_usage(node, shape, sign)
        self._add_gang(gang, node, sign)

    def drop_all_bound(self) -> None:
        """No bound pod counted any more (a relist follows): the sums of the
        assumptions alone."""
        nodes = set(self._usage)
        self._usage.clear()
        self._gangs.clear()
        for a in self.assumed.values():
            self._add_usage(a.node, a.shape, +1)
            self._add_gang(a.gang, a.node, +1)
        for node in nodes:
            self._changed(node)

    # -- sums -----------------------------------------------------------------------

    def usage(self, node: str) -> Usage:
        return self._usage.get(node, (0, 0, 0, ()))

    def assumed_usage(self, node: str) -> tuple[int, MigCounts]:
        return self._assumed_usage.get(node, (0, ()))

    def gang_nodes(self, gang: str) -> dict[str, int]:
        return dict(self._gangs.get(gang, {}))

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

    def _add_usage(self, node: str, s: PodShape, sign: int) -> None:
        g, c, m, mig = self._usage.get(node, (0, 0, 0, ()))
        g, c, m = g + sign * s.gpus, c + sign * s.cpu_milli, m + sign * s.memory_bytes
        if s.mig:
            mig = add_mig(mig, s.mig, sign)
        if (g, c, m, mig) == (0, 0, 0, ()):
            self._usage.pop(node, None)
        else:
            self._usage[node] = (g, c, m, mig)
        self._changed(node)

    def _add_assumed(self, node: str, s: PodShape, sign: int) -> None:
        g, mig = self._assumed_usage.get(node, (0, ()))
        g += sign * s.gpus
        if s.mig:
            mig = add_mig(mig, s.mig, sign)
        if (g, mig) == (0, ()):
            self._assumed_usage.pop(node, None)
        else:
            self._assumed_usage[node] = (g, mig)

    # -- assumptions ----------------------------------------------------------------

    def assume(
        self, uid: str, node: str, shape: PodShape, now: float, ttl_s: float, gang: str,
        wall: float,
    ) -> None:  # fmt: skip
        old = self.assumed.add(uid, node, shape, now, ttl_s, gang, wall)
        if old is not None:
            self._unassume_usage(old)
        self._add_usage(node, shape, +1)
        self._add_assumed(node, shape, +1)
        self._add_gang(gang, node, +1)

    def _unassume_usage(self, a: _Assumed) -> None:
        self._add_usage(a.node, a.shape, -1)
        self._add_assumed(a.node, a.shape, -1)
        self._add_gang(a.gang, a.node, -1)

    def unassume_if_failed_since(self, uid: str, failed_at: float) -> None:
        a = self.assumed.get(uid)
        if a is not None and failed_at >= math.floor(a.assumed_wall):
            self.drop_assumed(uid)

    def drop_assumed(self, uid: str) -> None:
        a = self.assumed.pop(uid)
        if a is not None:
            self._unassume_usage(a)

    def expire(self, now: Callable[[], float]) -> None:
        """Drop the assumptions whose time ran out (the clock read only if any)."""
        if self.assumed:
            for a in self.assumed.expire(now()):
                self._unassume_usage(a)
