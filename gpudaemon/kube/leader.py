"""Leader election on a coordination.k8s.io Lease, as client-go's leaderelection does it:
take the Lease when it is free or expired, renew it while leading, and write only with
the resourceVersion read (optimistic concurrency), so two replicas never both lead.

A leader that cannot renew steps down before anyone else may take over: it counts two
thirds of the duration (client-go's renew deadline) from the start of its last
successful renewal, while the others wait the whole duration from the renewTime it
wrote. A standby tries again the moment the holder's Lease runs out, so a dead leader
is replaced one duration after its last renewal.

The renewTime is the leader's wall clock, read by the standby's: with clocks apart, it
alone could let a standby take over while the leader still acts. So a standby also
waits, on its own monotonic clock, the renew deadline from when it last saw the Lease
change (as client-go counts from its own observation): by then the leader, which
renewed before that, has stepped down, whatever the wall clocks say.

Another identity's Lease is believed only within our bounds (`lease_held_until`): a
renewTime more than a minute ahead of our clock, or a duration over an hour, is not
held, and a standby takes it over after its renew deadline, as from a dead leader.

The leader can keep a little state in an annotation on the Lease (`save` gives the text
on every write, `load` gets the text found when it takes the Lease), so whoever leads
next, a standby or the same pod after a crash, carries on from it. `annotations` gives
more annotations for every write that are not carried on (the rebalancer's
reservations, which others read only while the Lease is held).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from loguru import logger

from gpudaemon.errors import KubeConflictError, KubeError, KubeNotFoundError
from gpudaemon.kube.client import KubeClient
from gpudaemon.kube.lease import MAX_LEADER_LEASE_S, lease_held_until, lease_path, micro_time
from gpudaemon.logsetup import LogLimiter


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
        state_key: str = "",
        save: Callable[[], str] | None = None,
        load: Callable[[str], None] | None = None,
        annotations: Callable[[], Mapping[str, str]] | None = None,
    ) -> None:
        self.client, self.namespace, self.name = client, namespace, name
        self.state_key, self._save, self._load = state_key, save, load
        self._annotations = annotations  # more of the leader's state, on every write
        self.wrote = False  # the last attempt wrote the Lease as its holder
        self._errors = LogLimiter(60.0, clock)
        self.identity, self.duration_s = identity, duration_s
        self.wall, self.clock = wall, clock
        self._renewed_at: float | None = None  # monotonic start of our last renewal
        self.renew_deadline_s = duration_s * 2 / 3
        self.transitions = 0
        self._other_expires: float | None = None  # wall time another holder's Lease ends
        self._seen: tuple[str, str, str] | None = None  # (holder, renewTime, rv) last seen
        self._seen_at = 0.0  # monotonic time it was first seen

    @property
    def leading(self) -> bool:
        """True while our last renewal is younger than the renew deadline."""
        return (
            self._renewed_at is not None and self.clock() - self._renewed_at < self.renew_deadline_s
        )

    def retry_in(self, period_s: float) -> float:
        """Seconds until the next attempt: `period_s` while leading, else until the
        holder's Lease runs out (and a little), whichever comes first."""
        if self.leading or self._other_expires is None:
            return period_s
        wait = max(
            self._other_expires - self.wall(),
            self._seen_at + self.renew_deadline_s - self.clock(),
        )
        return max(0.05, min(period_s, wait + 0.05))

    def try_acquire_or_renew(self) -> bool:
        """One attempt; True when we lead afterwards. API errors mean "not now"."""
        path = lease_path(self.namespace, self.name)
        now = self.wall()
        was = self.leading
        self.wrote = False
        try:
            try:
                lease = self.client.request("GET", path)
            except KubeNotFoundError:
                self._write("POST", lease_path(self.namespace), self._body(None, now, 0), now)
                return True
            spec = lease.get("spec") or {}
            holder = spec.get("holderIdentity") or ""
            # By our rules, not as written: a renewTime from the future or a duration
            # past the cap is not held (kube/lease.py), so a forged Lease is taken over.
            held_until = lease_held_until(lease, now, max(MAX_LEADER_LEASE_S, self.duration_s))
            expired = held_until is None or now >= held_until
            record = (holder, str(spec.get("renewTime") or ""),
                      str((lease.get("metadata") or {}).get("resourceVersion") or ""))  # fmt: skip
            if record != self._seen:
                self._seen, self._seen_at = record, self.clock()
            if holder and holder != self.identity:
                # Whatever the wall clocks say: not before the holder has stepped down.
                expired = expired and self.clock() - self._seen_at >= self.renew_deadline_s
            if holder != self.identity and not expired:
                self._other_expires = held_until
                self._lost()
                return False
            self._other_expires = None
            if not was and self._load is not None and self.state_key:
                ann = (lease.get("metadata") or {}).get("annotations") or {}
                self._load(str(ann.get(self.state_key) or ""))  # what the last leader kept
            transitions = int(spec.get("leaseTransitions") or 0)
            if holder != self.identity:
                transitions += 1
            self._write("PUT", path, self._body(lease, now, transitions), now)
            return True
        except KubeConflictError:
            self._lost()  # someone else wrote first: they lead
            return False
        except KubeError as e:
            if self._errors.allow(str(e)):  # the same failure once a minute, not per try
                logger.warning("rebalancer: leader election: {}", e)
            return self.leading  # keep leading until our own lease runs out

    def checkpoint(self) -> bool:
        """Renew now, writing the current state: True only when the Lease was written
        with us as holder (an API error keeps `leading` but writes nothing)."""
        self.try_acquire_or_renew()
        return self.wrote

    def _body(self, old: dict[str, Any] | None, now: float, transitions: int) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        annotations = dict(((old or {}).get("metadata") or {}).get("annotations") or {})
        if self._save is not None and self.state_key:
            annotations[self.state_key] = self._save()
        if self._annotations is not None:
            annotations.update(self._annotations())
        if annotations:
            meta["annotations"] = annotations
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
        start = self.clock()
        self.client.request(method, path, body)
        self._renewed_at = start
        self.wrote = True
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
                body["spec"]["holderIdentity"] = ""  # nobody's: take it now (client-go too)
                self.client.request("PUT", path, body)
        except KubeError:
            pass
        self._renewed_at = None
