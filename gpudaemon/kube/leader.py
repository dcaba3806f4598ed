"""Leader election on a coordination.k8s.io Lease, as client-go's leaderelection does it:
take the Lease when it is free or expired, renew it while leading, and write only with
the resourceVersion read (optimistic concurrency), so two replicas never both lead.

A replica that fails to renew for a whole lease duration steps down before anyone else
may take over: it counts from its own last successful renewal, with the same duration.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from loguru import logger

from gpudaemon.errors import KubeConflictError, KubeError, KubeNotFoundError
from gpudaemon.kube.client import KubeClient
from gpudaemon.kube.lease import lease_expiry, lease_path, micro_time


class LeaderElector:
    def __init__(
        self,
        client: KubeClient,
        namespace: str,
        name: str,
        identity: str,
        duration_s: int,
        *,
        wall: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client, self.namespace, self.name = client, namespace, name
        self.identity, self.duration_s = identity, duration_s
        self.wall, self.clock = wall, clock
        self._renewed_at: float | None = None  # monotonic time of our last renewal
        self.transitions = 0

    @property
    def leading(self) -> bool:
        """True while our last renewal is younger than the lease duration."""
        return self._renewed_at is not None and self.clock() - self._renewed_at < self.duration_s

    def try_acquire_or_renew(self) -> bool:
        """One attempt; True when we lead afterwards. API errors mean "not now"."""
        path = lease_path(self.namespace, self.name)
        now = self.wall()
        try:
            try:
                lease = self.client.request("GET", path)
            except KubeNotFoundError:
                self._write("POST", lease_path(self.namespace), self._body(None, now, 0), now)
                return True
            spec = lease.get("spec") or {}
            holder = spec.get("holderIdentity") or ""
            expiry = lease_expiry(lease)
            expired = expiry is None or datetime.fromtimestamp(now, UTC) >= expiry
            if holder != self.identity and not expired:
                self._lost()
                return False
            transitions = int(spec.get("leaseTransitions") or 0)
            if holder != self.identity:
                transitions += 1
            self._write("PUT", path, self._body(lease, now, transitions), now)
            return True
        except KubeConflictError:
            self._lost()  # someone else wrote first: they lead
            return False
        except KubeError as e:
            logger.warning("rebalancer: leader election: {}", e)
            return self.leading  # keep leading until our own lease runs out

    def _body(self, old: dict[str, Any] | None, now: float, transitions: int) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        spec: dict[str, Any] = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": self.duration_s,
            "renewTime": micro_time(now),
            "leaseTransitions": transitions,
        }
        if old is not None:
            meta["resourceVersion"] = (old.get("metadata") or {}).get("resourceVersion")
            prev = old.get("spec") or {}
            same = prev.get("holderIdentity") == self.identity
            spec["acquireTime"] = prev.get("acquireTime") if same else micro_time(now)
        else:
            spec["acquireTime"] = micro_time(now)
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": meta,
            "spec": spec,
        }

    def _write(self, method: str, path: str, body: dict[str, Any], now: float) -> None:
        was = self.leading
        self.client.request(method, path, body)
        self._renewed_at = self.clock()
        if not was:
            self.transitions += 1
            logger.info(
                "rebalancer: {} now leads (Lease {}/{})", self.identity, self.namespace, self.name
            )

    def _lost(self) -> None:
        if self._renewed_at is not None:
            logger.warning("rebalancer: {} no longer leads", self.identity)
        self._renewed_at = None

    def release(self) -> None:
        """Step down at shutdown so another replica need not wait out the Lease."""
        if not self.leading:
            return
        path = lease_path(self.namespace, self.name)
        try:
            lease = self.client.request("GET", path)
            if (lease.get("spec") or {}).get("holderIdentity") == self.identity:
                body = self._body(
                    lease, self.wall(), int((lease.get("spec") or {}).get("leaseTransitions") or 0)
                )
                body["spec"]["leaseDurationSeconds"] = 1
                body["spec"]["renewTime"] = micro_time(self.wall() - 2)
                self.client.request("PUT", path, body)
        except KubeError:
            pass
        self._renewed_at = None
