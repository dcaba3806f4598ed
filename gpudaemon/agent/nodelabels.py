"""The agent's labels and `<prefix>gpus` annotation on its own Node (server-side
apply, write only on change, drift repair, backoff) and the Lease heartbeat that
vouches for them."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

from loguru import logger

from gpudaemon.agent.nodelease import LeaseHeartbeat
from gpudaemon.agent.nodesync import FRESH_SINCE, _uid, in_sync, owned_keys
from gpudaemon.agent.nodewatch import NodeWatch, resource_version
from gpudaemon.errors import KubeError, SinkError
from gpudaemon.kube.lease import renew_cron
from gpudaemon.labels import Labels, LabelSet
from gpudaemon.schedule import Job

__all__ = ["FRESH_SINCE", "NodeLabelSink", "in_sync", "owned_keys"]


class NodeLabelSink(LeaseHeartbeat):
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
            wanted = ls.as_dict()
            self._wanted = wanted["labels"]
            wanted["labels"] = self._own(self._wanted)
            self._desired = self._with_fresh_since(wanted)
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
        if self.watch is not None:  # a long run (not --once): it stops now
            self.watch.stop()
            self.release_lease()
        self.client.close()

    def release_lease(self) -> None:
        """A graceful stop: the Lease stops vouching within a second (readers and
        `gpudaemon status` see the node as stale), not after its full duration. The
        labels, condition, taint and fault record stay: a stop lifts no quarantine."""
        with self._lock:
            if self._lease_uid is None:
                return  # never renewed by this process: nothing of ours to take back
            try:
                self.lease.release(self._lease_uid)
            except KubeError as e:
                logger.warning("{}; it expires on its own", e)
                return
            self._lease_uid = None
            logger.info("node {}: lease released (stopping)", self.node)

    # -- the Node watch ----------------------------------------------------------------

    def observe(self, node: Mapping[str, Any] | None) -> None:
        """Every view of our Node from the watch (None: it is gone). A new UID, or our
        labels, annotation or condition changed under us, is due for kube-retry at once
        (within a second) instead of at the next Lease renewal."""
        self._observe(node)
        if node is not None:
            for tell in self.node_observers:
                tell(node)

    def remove_annotation(self, key: str, value: str) -> None:
        """Remove one annotation if it still holds `value` (a JSON patch with a test:
        a newer value written meanwhile stays). KubeError when the write fails."""
        path = "/metadata/annotations/" + key.replace("~", "~0").replace("/", "~1")
        ops = [{"op": "test", "path": path, "value": value}, {"op": "remove", "path": path}]
        try:
            self.client.json_patch_node(self.node, ops)
        except KubeError as e:
            if e.status not in (409, 422):  # changed or gone meanwhile: nothing to remove
                raise

    def _observe(self, node: Mapping[str, Any] | None) -> None:
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
                desired = self._desired  # without the sharing labels others set
                assert desired is not None
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
