"""The agent's labels and `<prefix>gpus` annotation on its own Node (server-side
apply, write only on change, drift repair, backoff) and the Lease heartbeat that
vouches for them."""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NoReturn

from loguru import logger

from gpudaemon.agent.nodehealth import NodeHealthWriter
from gpudaemon.agent.nodewatch import NodeWatch, resource_version
from gpudaemon.errors import KubeError, KubeNotFoundError, SinkError
from gpudaemon.kube.backoff import Backoff
from gpudaemon.kube.client import FIELD_MANAGER, Credentials, KubeClient
from gpudaemon.kube.lease import LeaseRenewer, micro_time, renew_cron
from gpudaemon.labels import GpuHealth, Labels, LabelSet
from gpudaemon.labels.sanitize import DEFAULT_PREFIX
from gpudaemon.logsetup import LogLimiter
from gpudaemon.schedule import Job

FRESH_SINCE = "fresh-since"

if TYPE_CHECKING:
    from gpudaemon.agent.metrics.selfmetrics import AgentMetrics
    from gpudaemon.config import KubernetesConfig


def owned_keys(node: Mapping[str, Any], manager: str = FIELD_MANAGER) -> tuple[set[str], set[str]]:
    """Label and annotation keys the manager's Apply owns, from managedFields."""
    labels: set[str] = set()
    ann: set[str] = set()
    for entry in node.get("metadata", {}).get("managedFields") or []:
        if entry.get("manager") != manager or entry.get("operation") != "Apply":
            continue
        meta = (entry.get("fieldsV1") or {}).get("f:metadata", {})
        labels |= {k[2:] for k in meta.get("f:labels", {}) if k.startswith("f:")}
        ann |= {k[2:] for k in meta.get("f:annotations", {}) if k.startswith("f:")}
    return labels, ann


def in_sync(node: Mapping[str, Any], desired: Mapping[str, Mapping[str, str]]) -> bool:
    """True when the Node holds exactly our desired keys, owned by us, with our values."""
    meta = node.get("metadata", {})
    labels, ann = meta.get("labels") or {}, meta.get("annotations") or {}
    own_l, own_a = owned_keys(node)
    want_l, want_a = desired["labels"], desired["annotations"]
    return (
        own_l == set(want_l)
        and own_a == set(want_a)
        and all(labels.get(k) == v for k, v in want_l.items())
        and all(ann.get(k) == v for k, v in want_a.items())
    )


class NodeLabelSink:
    """Keeps the agent's labels and `<prefix>gpus` annotation on its own Node, and renews
    its freshness Lease.

    Writes only on change: it remembers what it last applied and sends nothing while
    the desired set is the same. After an error, and every `resync_seconds`, it reads
    the Node and writes only if the Node drifted. An API error arms an exponential
    backoff and is raised as our KubeError (the agent's job wrapper counts it; the sink
    logs one line when the failures start and one when labels are written again);
    the `kube-retry` job retries as soon as the backoff expires, so labels converge
    within one backoff cap of the API server's recovery.

    A Node deleted and re-created under the same name has a new UID, which means "not
    written by us": the labels are applied again and the Lease re-owned at once. The
    Node watch (`start`, agent/nodewatch.py) sees it within a second, as it sees our
    labels, annotation or condition removed; without a live watch the heartbeat's read
    of the Node notices it, within one renewal period. The Lease is renewed only for
    the UID the labels were last written to.
    """

    name = "apiserver"

    def __init__(
        self,
        k: KubernetesConfig,
        node: str,
        creds: Credentials | None,
        metrics: AgentMetrics,
        *,
        client: KubeClient | None = None,
        clock: Callable[[], float] = time.time,
        rng: Callable[[], float] = random.random,
        prefix: str = DEFAULT_PREFIX,
        taint_unhealthy: bool = False,
    ) -> None:
        if client is None:
            if creds is None:
                raise SinkError("no Kubernetes credentials")
            client = KubeClient.from_credentials(
                creds, k.request_timeout_seconds, k.connect_timeout_seconds
            )
        self.client = client
        self.node = node
        self.metrics = metrics
        self.clock = clock
        self.backoff = Backoff(1.0, k.backoff_max_seconds, rng)
        self.resync_s = k.resync_seconds
        self.lease = LeaseRenewer(
            client,
            k.lease_namespace,
            self.node,
            k.lease_duration_seconds,
            holder=f"{k.holder_identity}/{os.getpid()}",
            clock=clock,
        )
        self.health = NodeHealthWriter(client, node, prefix, taint=taint_unhealthy, clock=clock)
        self._unhealthy: tuple[GpuHealth, ...] = ()  # unhealthy and degraded GPUs
        self._gpus = 0
        self.fresh: Callable[[], bool] = lambda: True
        # Called with the Node whenever a reconcile reads it in full (the agent seeds
        # its fault record from it when the read at start-up failed).
        self.on_read: Callable[[Mapping[str, Any]], None] | None = None
        self._lock = threading.Lock()
        self._desired: dict[str, dict[str, str]] | None = None
        self._applied: dict[str, dict[str, str]] | None = None
        self._verified_at = -float("inf")
        self._retry_at = -float("inf")
        self._node_uid: str | None = None  # the Node our labels were written to
        self._lease_uid: str | None = None  # the owner in our last Lease renewal
        self._label_log = LogLimiter()  # one line per outage, one when it ends
        self._lease_log = LogLimiter()
        # A renewal is owed: none yet for the Node the labels went to, or the last one
        # failed. kube-retry pays it within a second (with its own backoff), so a new
        # or restarted agent, a re-created Node or a lost Lease do not wait for the
        # next renewal tick (minutes) before the extender trusts the node.
        self._lease_owed = True
        # `<prefix>fresh-since`: written once, just after a renewal that makes the node
        # fresh again (this process's first, or the first after the Lease lapsed). A
        # Lease is not a kube-scheduler event; this Node update is, so GPU pods the
        # extender turned away as "stale" are retried at once instead of waiting for
        # the scheduler's periodic flush of unschedulable pods (minutes).
        self._fresh_key = prefix + FRESH_SINCE
        self._fresh_since: str | None = None
        self._lease_ok_at = -float("inf")
        self._lease_backoff = Backoff(1.0, k.backoff_max_seconds, rng)
        self._lease_retry_at = -float("inf")
        # The Node watch (started by `start`): its last view of the Node (None: gone),
        # and the newest resourceVersion we wrote or read, so a view from before our
        # own write is not taken for someone else's edit.
        self.watch: NodeWatch | None = None
        self._view: Mapping[str, Any] | None = None
        self._known_rv: int | None = None
        # Repairs of edits made under us, spaced out: a controller that keeps removing
        # our labels is not answered with a write per removal.
        self._drift_backoff = Backoff(1.0, k.backoff_max_seconds, rng)
        self._drift_at = -float("inf")

    @property
    def client(self) -> KubeClient:
        return self._client

    @client.setter
    def client(self, c: KubeClient) -> None:
        self._client = c
        if hasattr(self, "health"):
            self.health.client = c

    # -- label sink interface ----------------------------------------------------------

    def read_node(self) -> dict[str, Any]:
        """The Node as the API server has it now (KubeError on failure)."""
        return self.client.get_node(self.node)

    def set_freshness(self, fresh: Callable[[], bool]) -> None:
        """The Lease is renewed only while this says the agent's data is fresh."""
        self.fresh = fresh

    def apply(self, ls: LabelSet) -> bool:
        """Write if changed. Raises KubeError (after arming the backoff) when it fails."""
        if not isinstance(ls.labels, Labels):
            raise SinkError("refusing labels that did not pass through sanitize_value")
        with self._lock:
            self._desired = self._with_fresh_since(ls.as_dict())
            self._unhealthy, self._gpus = ls.verdicts, ls.gpus
            wrote = self._reconcile()
            return self._sync_health() or wrote

    def retry(self) -> bool:
        """Scheduled every second: does nothing unless a write (labels, or an owed
        Lease renewal) is pending and due. Raises KubeError when the retry fails (the
        job wrapper counts and logs it)."""
        with self._lock:
            if self._desired is None:
                return False
            if self._applied != self._desired:
                return self._reconcile() | self._sync_health()
            if self.health.pending(self._unhealthy, self._gpus):
                return self._sync_health()
            if self._lease_owed and self.clock() >= self._lease_retry_at and self.fresh():
                # As a heartbeat: never for a Node that is gone or not the one written.
                return self._heartbeat()
            return False

    def jobs(self) -> list[Job]:
        return [
            Job("kube-retry", "* * * * * *", self.retry),
            Job("lease", renew_cron(self.lease.duration_s), self.heartbeat),
        ]

    def start(self) -> None:
        """Start the watch of our own Node (the agent's long-running mode only)."""
        if self.watch is None:
            self.watch = NodeWatch(self.client, self.node, self.observe)
            self.watch.start()

    def close(self) -> None:
        if self.watch is not None:
            self.watch.stop()
        self.client.close()

    # -- the Node watch ----------------------------------------------------------------

    def observe(self, node: Mapping[str, Any] | None) -> None:
        """Every view of our Node from the watch (None: it is gone). A new UID, or our
        labels, annotation or condition changed under us, is due for kube-retry at once
        (within a second) instead of at the next Lease renewal."""
        with self._lock:
            self._view = node
            if node is None:
                # Gone: the next heartbeat stops vouching and hands it to kube-retry.
                # Not at once: a Node deleted and created again within a second (the
                # usual replacement) is then relabelled with no failed attempt.
                return
            rv = resource_version(node)
            if rv is not None and self._known_rv is not None and rv < self._known_rv:
                return  # older than our own last write or read: nothing new
            self._note(node)
            if not self._same_node(node):
                # Replaced (or back after a deletion): write at once, whatever backoff
                # the missing Node had built up.
                self._applied = None
                self.backoff.reset()
                self._retry_at = self._lease_retry_at = -float("inf")
                self._lease_backoff.reset()
                return
            if self._desired is None or self._applied != self._desired:
                return  # a write is pending anyway
            if not in_sync(node, self._desired):
                logger.info("node {}: labels changed under us; writing them again", self.node)
                self._applied = None
                self._repair_soon()
                return
            self._verified_at = self.clock()
            self.health.seen(node)  # a condition removed under us: pending, rewritten
            if self.health.pending(self._unhealthy, self._gpus):
                self._repair_soon()

    def _repair_soon(self) -> None:
        """Due at once the first time; repeated repairs within a resync period back off."""
        now = self.clock()
        repeated = now - self._drift_at <= self.resync_s
        if not repeated:
            self._drift_backoff.reset()
        delay = self._drift_backoff.next_delay()
        self._drift_at = now
        self._retry_at = max(self._retry_at, now + (delay if repeated else 0.0))

    def _note(self, obj: Any) -> None:
        """Remember the newest resourceVersion we have written or read."""
        rv = resource_version(obj) if isinstance(obj, Mapping) else None
        if rv is not None and (self._known_rv is None or rv > self._known_rv):
            self._known_rv = rv

    def _watch_live(self) -> bool:
        return self.watch is not None and self.watch.live

    # -- reconcile ---------------------------------------------------------------------

    def _reconcile(self) -> bool:
        now = self.clock()
        desired = self._desired
        assert desired is not None
        if now < self._retry_at:
            return False  # backing off; retry() picks it up when due
        try:
            if desired == self._applied and now - self._verified_at < self.resync_s:
                # Nothing to write, and no read: a re-created Node (a new UID, our
                # labels gone) or labels edited under us are noticed by the Lease
                # heartbeat's one read per renewal (0.5 reads a node-minute at the
                # defaults; one per reconcile was 2, ~170/s at 5,000 nodes).
                self._ok(now, "unchanged")
                return False
            if self._applied is None or desired == self._applied:
                # First write, after an error, or a periodic resync: read, and write
                # only if the Node drifted (a restarted agent does not rewrite it).
                node = self.client.get_node(self.node)
                self._note(node)
                self._same_node(node)
                self._node_uid = _uid(node)
                self.health.seen(node)
                if self._fresh_since is None:
                    # Keep the last agent's value until our own Lease renewal replaces
                    # it: one write per restart, not two.
                    prev = ((node.get("metadata") or {}).get("annotations") or {}).get(
                        self._fresh_key
                    )
                    if isinstance(prev, str) and prev:
                        self._fresh_since = prev
                        desired = self._desired = self._with_fresh_since(desired)
                if self.on_read is not None:
                    self.on_read(node)
                if in_sync(node, desired):
                    self._written(desired, now, "unchanged")
                    return False
            result = self.client.apply_node(self.node, desired["labels"], desired["annotations"])
            self._note(result)
            self._same_node(result)  # a change written to a re-created Node: say so
            self._node_uid = _uid(result) or self._node_uid
        except KubeError as e:
            self._applied = None
            delay = self.backoff.next_delay()
            self._retry_at = now + delay
            self.metrics.node_writes.labels("error").inc()
            if self._label_log.allow():
                logger.warning(
                    "node {}: labels not written: {}; retrying with backoff (up to {:.0f}s), "
                    "one more line when they are written",
                    self.node,
                    e,
                    self.backoff.cap,
                )
            # Raised for the job wrapper to count (poll_errors; `run --once` exits 1);
            # logged above, once per outage.
            err = type(e)(
                f"node {self.node}: labels not written, retry in {delay:.1f}s: {e}", e.status
            )
            err.reported = True
            raise err from None
        self._written(desired, now, "success")
        return True

    def _sync_health(self) -> bool:
        """The GPUHealthy condition and optional taint, once the labels are in place
        (they share the labels' backoff). Raises KubeError when the write fails."""
        if self._applied is None or self._applied != self._desired:
            return False
        now = self.clock()
        if now < self._retry_at:
            return False
        try:
            wrote = self.health.sync(self._unhealthy, self._gpus)
            self._note(self.health.last_write)
            return wrote
        except KubeError as e:
            self.health.forget()
            delay = self.backoff.next_delay()
            self._retry_at = now + delay
            if self._label_log.allow():
                logger.warning(
                    "node {}: GPU health condition not written: {}; retrying with backoff",
                    self.node,
                    e,
                )
            err = type(e)(f"node {self.node}: GPU health not written: {e}", e.status)
            err.reported = True
            raise err from None

    def _same_node(self, node: Mapping[str, Any]) -> bool:
        """False, with one log line, when the Node's UID is not the one we wrote to."""
        uid = _uid(node)
        if self._node_uid is None or uid == self._node_uid:
            return True
        logger.warning(
            "node {}: the Node was re-created (uid {} -> {}): writing its labels again and "
            "re-owning its Lease",
            self.node,
            self._node_uid,
            uid,
        )
        self._node_uid = None
        self.health.forget()
        return False

    def _written(self, desired: dict[str, dict[str, str]], now: float, result: str) -> None:
        """The Node holds our labels: record it, end an outage, re-own the Lease."""
        failures = self.backoff.failures
        self._applied, self._verified_at = desired, now
        self._ok(now, result)
        if self._label_log.forget():
            logger.info("node {}: labels written after {} failed attempt(s)", self.node, failures)
        if (self._lease_owed or self._lease_uid != self._node_uid) and self.fresh():
            # The first labels of this process, or the Lease names another Node
            # (re-created): renew now, together with the labels, not at the next
            # renewal tick, so readers trust the node within this reconcile (only
            # while the data is fresh, as for every renewal).
            with contextlib.suppress(KubeError):  # logged; kube-retry retries it
                self._renew()

    def _ok(self, now: float, result: str) -> None:
        self.backoff.reset()
        self._retry_at = -float("inf")
        self.metrics.node_writes.labels(result).inc()
        self.metrics.last_reconcile_timestamp_seconds.set(now)

    # -- freshness Lease ---------------------------------------------------------------

    def heartbeat(self) -> bool:
        """Renew the node's Lease; False when skipped, KubeError when it fails. Skipped
        while the data is stale or the Node's labels are not known to be current, so
        an expired Lease means "do not trust this node's labels and annotation". It
        never vouches for a Node it has not written: the Node's UID (from the API
        server's cache) must be the one the labels went to; a new one is re-labelled
        by the next `kube-retry` (within a second), which re-owns the Lease. This read
        also stands in for the label reconcile's: a re-created Node or labels edited
        under us are noticed here, within one renewal period. While the Node watch is
        live its last view is used instead, and the heartbeat reads nothing."""
        with self._lock:
            return self._heartbeat()

    def _heartbeat(self) -> bool:
        current = self._applied is not None and self._applied == self._desired
        if not current or self._node_uid is None or not self.fresh():
            return False
        if self._watch_live():
            # The watch has told us of every change since its list: its view is as
            # good as a read, and costs none.
            if self._view is None:
                self._applied = None  # gone: kube-retry's reconcile says so, once
                return False
            node: Mapping[str, Any] = self._view
            rv = resource_version(node)
            if rv is not None and self._known_rv is not None and rv < self._known_rv:
                self._verified_at = self.clock()  # our own write is newer than the view
                return self._renew()
        else:
            try:
                node = self.client.get_node(self.node, cached=True)
            except KubeNotFoundError:
                # The Node is gone (one line from kube-retry's reconcile, which
                # re-labels the Node when it comes back and re-owns the Lease then).
                self._applied = None
                return False
            except KubeError as e:
                self._owe_lease()
                self._lease_failed(type(e)(f"node {self.node}: lease not renewed: {e}", e.status))
            self._note(node)
        if not self._same_node(node):
            self._applied = None  # kube-retry writes the labels again
            return False
        # The reconcile's check, made here: this read is the agent's only steady one.
        if self._desired is not None and not in_sync(node, self._desired):
            logger.info("node {}: labels changed under us; writing them again", self.node)
            self._applied = None  # kube-retry, within a second (same Node: still renew)
        else:
            self._verified_at = self.clock()
        return self._renew()

    def _owe_lease(self) -> None:
        """A renewal failed: kube-retry tries again after the Lease's own backoff."""
        self._lease_owed = True
        self._lease_retry_at = self.clock() + self._lease_backoff.next_delay()

    def _announce_fresh(self, now: float) -> None:
        """Write `fresh-since` now, after the Lease, so the scheduler's retry finds the
        node fresh. A failure is left to kube-retry (the desired set includes it)."""
        assert self._desired is not None
        self._fresh_since = micro_time(now)
        desired = self._with_fresh_since(
            {"labels": dict(self._desired["labels"]),
             "annotations": dict(self._desired["annotations"])}
        )  # fmt: skip
        in_place = self._applied == self._desired
        self._desired = desired
        if not in_place:
            return
        try:
            self._note(self.client.apply_node(self.node, desired["labels"], desired["annotations"]))
        except KubeError:
            self._applied = None
            return
        self._applied = desired
        self.metrics.node_writes.labels("success").inc()

    def _with_fresh_since(self, desired: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
        if self._fresh_since is not None:
            desired["annotations"][self._fresh_key] = self._fresh_since
        return desired

    def _renew(self) -> bool:
        """Renew with the Node we wrote to as owner; log one line per outage."""
        uid = self._node_uid
        try:
            self.lease.renew(uid)
        except KubeError as e:
            self._owe_lease()
            self._lease_failed(e)
        owner_changed = self._lease_uid != uid  # first renewal, or a re-created Node
        self._lease_uid = uid
        self._lease_owed = False
        now = self.clock()
        lapsed = now - self._lease_ok_at > self.lease.duration_s
        if (lapsed or owner_changed) and self._desired is not None:
            self._announce_fresh(now)
        self._lease_ok_at = now
        self._lease_backoff.reset()
        if self._lease_log.forget():
            logger.info("node {}: lease renewed again", self.node)
        return True

    def _lease_failed(self, e: KubeError) -> NoReturn:
        if self._lease_log.allow():
            logger.warning("{}; one more line when it is renewed again", e)
        e.reported = True
        raise e


def _uid(obj: Mapping[str, Any]) -> str | None:
    uid = (obj.get("metadata") or {}).get("uid")
    return uid if isinstance(uid, str) and uid else None
