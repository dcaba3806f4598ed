"""The freshness Lease the agent renews for its Node, and `<prefix>fresh-since`: the
heartbeat half of NodeLabelSink (agent/nodelabels.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NoReturn

from loguru import logger

from gpudaemon.agent.nodesync import NodeSinkState, in_sync
from gpudaemon.agent.nodewatch import resource_version
from gpudaemon.errors import KubeError, KubeNotFoundError
from gpudaemon.kube.lease import micro_time


class LeaseHeartbeat(NodeSinkState):
    """Renews the node's Lease only for labels known to be current on the Node they
    were written to; mixed into NodeLabelSink."""

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
